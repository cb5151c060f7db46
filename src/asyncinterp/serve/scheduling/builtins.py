"""Interventions a language-model server registers by default (``builtin_interventions=True``).

Each works for ``trace`` (one pass) and ``generate`` (every step) alike and
takes typed, validated parameters:

* ``top_k(k)`` — the top ``k`` next-token ids and probabilities at the last position;
* ``read(module, position)`` — a module's output (its first tensor) at one position;
* ``steer(module, vector, strength, k)`` — add ``strength * vector`` to a module's output, then ``top_k``;
* ``ablate(module, k)`` — zero a module's output, then ``top_k``.
"""

from __future__ import annotations

from typing import Annotated

import torch

from .params import MaxLen, ModulePath, Range  # noqa: F401  (MaxLen: for users copying these)


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    if hasattr(value, "logits"):
        return value.logits
    raise TypeError(f"the module's output is a {type(value).__name__}, not a tensor")


def _envoy(m, path: str):
    e = m
    for part in path.split("."):
        e = e.child(part)
    return e


async def _next_token_logits(m):
    """``[rows, vocab]``: the next-token logits of this pass."""
    if hasattr(m, "logits_of"):   # vLLM's root: the logits are a point of their own (its output is a hidden state)
        return await m.logits
    return _first_tensor(await m.output)[:, -1]


async def _top_k(m, k):
    logits = (await _next_token_logits(m)).float()
    probs = logits.softmax(-1)
    p, ids = probs.topk(k, dim=-1)
    return {"ids": ids, "probs": p}


async def top_k(m, k: Annotated[int, Range(1, 100)] = 10):
    """Top ``k`` next-token ids and probabilities at the last position (every step when generating)."""
    out = None
    async for _ in m.steps():
        out = await _top_k(m, k)
    return out


async def read(m, module: ModulePath, position: Annotated[int, Range(-4096, 4095)] = -1):
    """The output of ``module`` (its first tensor) at ``position`` (every step when generating: a list)."""
    target = _envoy(m, module)
    values = []
    async for _ in m.steps():
        h = _first_tensor(await target.output)
        values.append(h[:, position].clone() if h.dim() >= 3 else h.clone())
    return values[0] if len(values) == 1 else values


async def steer(m, module: ModulePath, vector: torch.Tensor, strength: Annotated[float, Range(-1000, 1000)] = 1.0,
                k: Annotated[int, Range(1, 100)] = 10):
    """Add ``strength * vector`` to ``module``'s output at every position and step; returns ``top_k``."""
    target = _envoy(m, module)
    out = None
    async for _ in m.steps():
        h = _first_tensor(await target.output)
        if vector.shape != h.shape[-1:]:
            raise ValueError(f"vector has shape {tuple(vector.shape)}, {module} outputs width {h.shape[-1]}")
        h.add_(strength * vector.to(h.dtype))
        out = await _top_k(m, k)
    return out


async def ablate(m, module: ModulePath, k: Annotated[int, Range(1, 100)] = 10):
    """Zero ``module``'s output at every step; returns ``top_k``."""
    target = _envoy(m, module)
    out = None
    async for _ in m.steps():
        h = _first_tensor(await target.output)
        h.zero_()
        out = await _top_k(m, k)
    return out


def register_builtins(server) -> None:
    for fn in (top_k, read, steer, ablate):
        server.intervention(fn.__name__)(fn)
