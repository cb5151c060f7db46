"""Input batching: several invokes' inputs become one model call.

Each invoke's input is normalised to ``(args, kwargs)`` (a tensor is one
positional argument, a tuple is the positional arguments, a dict the keyword
arguments). Tensors are concatenated along dim 0 and every invoke owns the
rows it contributed; non-tensor arguments must agree between invokes.
Model wrappers with their own inputs (tokenised prompts, vLLM requests)
replace this with their own batcher.
"""

from __future__ import annotations

import torch

from .views import WHOLE_BATCH, BatchLayout


def as_call(input):
    """Normalise one invoke input to ``(args, kwargs)``."""
    if isinstance(input, torch.Tensor):
        return (input,), {}
    if isinstance(input, tuple):
        return input, {}
    if isinstance(input, list) and input and all(isinstance(x, torch.Tensor) for x in input):
        return tuple(input), {}
    if isinstance(input, dict):
        return (), dict(input)
    return (input,), {}


def _rows(args, kwargs):
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return v.shape[0]
    raise ValueError("cannot batch this input: it has no tensor with a batch dimension; "
                     "pass one invoke only, or tensors whose dim 0 is the batch")


def _combine(parts, where):
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(p, torch.Tensor) for p in parts):
            raise TypeError(f"invoke inputs disagree at {where}: some are tensors, some are not")
        try:
            return torch.cat(parts, dim=0)
        except RuntimeError as exc:
            shapes = ", ".join(str(tuple(p.shape)) for p in parts)
            raise ValueError(f"cannot batch invoke inputs at {where}: shapes {shapes} differ beyond dim 0") from exc
    for p in parts[1:]:
        if p is not first and p != first:
            raise ValueError(f"invoke inputs disagree at {where}: non-tensor arguments must be equal, got {first!r} and {p!r}")
    return first


def batch_inputs(inputs):
    """Combine invoke inputs (``None`` = no input) into ``(args, kwargs, layout)``."""
    if len(inputs) == 1 and type(inputs[0]) is torch.Tensor:   # the common case: one tensor
        return (inputs[0],), {}, WHOLE_BATCH
    given = [(i, as_call(x)) for i, x in enumerate(inputs) if x is not None]
    if not given:
        raise ValueError("no invoke has an input: give at least one invoke an input to run the model on")
    if len(given) == 1:
        args, kwargs = given[0][1]
        return args, kwargs, WHOLE_BATCH
    if all(type(x) is torch.Tensor and x.dim() for x in inputs if x is not None):
        return _batch_tensors(inputs)
    calls = [c for _, c in given]
    nargs = {len(a) for a, _ in calls}
    keys = {tuple(sorted(k)) for _, k in calls}
    if len(nargs) != 1 or len(keys) != 1:
        raise ValueError("invoke inputs must have the same arguments to be batched together")
    args = tuple(_combine([a[j] for a, _ in calls], f"argument {j}") for j in range(nargs.pop()))
    kwargs = {k: _combine([kw[k] for _, kw in calls], f"keyword {k!r}") for k in calls[0][1]}
    spans = [None] * len(inputs)
    start = 0
    for i, (a, kw) in given:
        n = _rows(a, kw)
        spans[i] = (start, start + n)
        start += n
    return args, kwargs, BatchLayout(spans, start)


def _batch_tensors(inputs):
    """Fast path: every invoke input is one tensor."""
    spans = [None] * len(inputs)
    parts = []
    start = 0
    for i, x in enumerate(inputs):
        if x is not None:
            n = x.shape[0]
            spans[i] = (start, start + n)
            start += n
            parts.append(x)
    try:
        batched = torch.cat(parts, dim=0)
    except RuntimeError as exc:
        shapes = ", ".join(str(tuple(p.shape)) for p in parts)
        raise ValueError(f"cannot batch invoke inputs: shapes {shapes} differ beyond dim 0") from exc
    return (batched,), {}, BatchLayout(spans, start)


def forward_kwargs(invokes) -> dict:
    """The forward keyword arguments given with the invokes (``tr.invoke(x, fn, scale=2.0)``).

    Invokes batched into one forward must agree on them (same names, equal
    values); invokes without input and without keywords do not count.
    """
    for inv in invokes:
        if inv.kwargs:
            break
    else:
        return {}   # the common case: no keywords at all
    merged = None
    for inv in invokes:
        if inv.input is None and not inv.kwargs:
            continue
        if merged is None:
            merged = dict(inv.kwargs)
        elif set(merged) != set(inv.kwargs) or any(merged[k] is not inv.kwargs[k] and merged[k] != inv.kwargs[k]
                                                     for k in merged):
            raise ValueError("invokes batched in one run must pass the same forward keyword arguments; "
                             f"got {sorted(merged)} and {sorted(inv.kwargs)}")
    return merged or {}
