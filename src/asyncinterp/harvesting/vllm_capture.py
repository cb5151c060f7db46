"""Recording harvested points inside a vLLM run: one request's values, chunk by chunk, joined per window.

Why this module exists: vLLM may split a prompt across engine steps, and
runs interventions where the model is (in process, or in each worker under
tensor parallelism, shipped by pickling). The harvest's vLLM engine
(:mod:`.engines`) and the in-engine reductions (:mod:`.in_engine`) both record
a window's points the same way; these are module-level functions so that the
interventions made from them pickle.
"""

from __future__ import annotations

import torch

from ..kernel.scheduler import current_kernel, current_task

__all__ = ["recorder", "join_chunks"]


def recorder(specs, chunks):
    """An intervention that records each point of ``specs`` as it fires for its request, chunk by chunk (vLLM
    may split a prompt across engine steps) into ``chunks[i]``. Module-level, so that it pickles (under tensor
    parallelism vLLM ships interventions to its workers)."""

    async def record(m):
        run = current_kernel().host
        group = current_task().group
        for i, spec in enumerate(specs):
            point = m.at(spec.path)
            read = point.read if point.key is not point else None
            run.tap(point.key, _tap(run, group, read, chunks[i]))
    return record


def _tap(run, group, read, out):
    def tap(value):
        if group not in run.layout.spans:     # this request has no tokens in this engine step
            return
        v = run.layout.view(value, group)
        if read is not None:
            v = read(v)
        out.append(v.detach().to(torch.float32, copy=True))
    return tap


def join_chunks(spec, parts, positions, context, w=0):
    """One window's recorded chunks of ``spec`` joined, at the kept positions: ``[1, P, D]``."""
    if not parts:
        raise RuntimeError(f"point {spec.path!r} did not fire for window {w} of the batch in vLLM")
    whole = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    if whole.shape[1] != context:     # the decode pass of the sampled token must not count
        whole = whole[:, :context]
    return spec.take(whole, positions, 1, context)
