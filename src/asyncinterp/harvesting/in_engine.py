"""Reductions computed where the activations are: inside the engine's own interventions (vLLM).

Why this module exists: a harvest that keeps only reductions should not move
activations at all. On vLLM the model's forward runs where its interventions
run (in process for one worker; in every worker process under tensor
parallelism, where vLLM ships them by ``collective_rpc``), and what an
intervention returns is what comes back to the driver. So each window's
request gets an intervention (:func:`window_reducer`) that records its points
as they fire, and when the request's steps end, runs the reductions on that
one window and returns their ``state_dict()`` (a mean and M2 per unit, the
window's top-k candidates, histogram counts): that, not ``[positions, width]``
activations, crosses the process boundary. The driver folds the per-window
states in window order with ``merge`` (:func:`merged`), which for the
reductions of :mod:`.reductions` gives the same bits as updating one state
batch by batch.
"""

from __future__ import annotations

import copy

import torch

from .batch import HarvestBatch
from .vllm_capture import join_chunks, recorder

__all__ = ["window_reducer", "merged", "run_batch"]


def window_reducer(specs, positions, context: int, window_id: int, token_ids, reductions):
    """The intervention of one window's request: record ``specs``, then return the reductions' states of
    this window (a list, one ``state_dict`` per reduction, in order)."""
    templates = [copy.deepcopy(r) for r in reductions]   # pickled with the intervention: no driver state
    token_ids = token_ids.detach().clone()

    async def reduce_window(m):
        chunks = [[] for _ in specs]
        await recorder(specs, chunks)(m)
        async for _ in m.steps():                         # the request's prefill, in however many steps
            pass
        acts = {spec.column: join_chunks(spec, parts, positions, context, window_id)
                for spec, parts in zip(specs, chunks)}
        batch = HarvestBatch(window_ids=torch.tensor([window_id]), token_ids=token_ids[None], acts=acts)
        states = []
        for r in templates:
            r = copy.deepcopy(r)
            r.update(batch)
            states.append(r.state_dict())
        return states

    return reduce_window


def merged(reductions, window_states) -> list:
    """Fresh copies of ``reductions`` holding the merge, in window order, of each window's returned states."""
    out = [copy.deepcopy(r) for r in reductions]
    fresh = [copy.deepcopy(r) for r in reductions]
    for states in window_states:
        if not isinstance(states, list) or len(states) != len(out):
            raise RuntimeError(f"a window's in-engine reduction returned {type(states).__name__}, not the "
                               f"{len(out)} reduction states expected")
        for r, template, state in zip(out, fresh, states):
            part = copy.deepcopy(template)
            part.load_state_dict(state)
            r.merge(part)
    return out


def run_batch(engine, ids, window_ids, reductions, empty, save_activations: bool) -> dict:
    """One batch of a harvest: the engine's activations (``{}`` when they are not kept), with ``reductions``
    updated. Without saved activations, an engine that reduces inside itself (vLLM: ``engine.reduce``) does
    so, from ``empty`` (the reductions with no state yet); otherwise the reductions see the batch here."""
    if reductions and not save_activations and hasattr(engine, "reduce"):
        for r, part in zip(reductions, engine.reduce(ids, window_ids, empty)):
            r.merge(part)
        return {}
    acts = engine(ids)
    if reductions:
        batch = HarvestBatch(window_ids=window_ids, token_ids=ids, acts=acts)
        for r in reductions:
            r.update(batch)
    return acts
