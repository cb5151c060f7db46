"""Values crossing into and out of submitted code.

In: what an ``await`` hands submitted code is a private copy of its own
rows (:func:`sanitize`): tensors, numbers, strings and containers of them;
any other object (the KV cache, a module, a config) becomes ``None``. Out:
what it returns or emits is plain tensors and values only (:func:`release`).
In-place edits of the private copies are checked and rebuilt into the
original structure here (:func:`check_replacement`, :func:`rebuild`).
"""

from __future__ import annotations

import copy

import torch

from ...kernel.errors import ReplacementError  # a ValueError, as a local run raises

from ...client import policy
from .tensors import DisableTorchFunction, plain, private_copy, version_of


class Record(dict):
    """A model output (``ModelOutput`` and other mappings) as submitted code sees it: items and attributes."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def sanitize(value, depth=0, leaves=None, path=(), graph=False, memo=None):
    """What submitted code receives: private copies of tensors, numbers, strings and containers of them;
    any other object (a KV cache holding every request's keys and values, a module, a config) becomes
    ``None``. ``leaves`` collects ``(path, raw_leaf, private_copy, version)`` for in-place write-back.
    ``graph``: copies of tensors that require grad stay connected to the autograd graph (a gradient request's
    awaited values; such a copy is always written back, see :meth:`.driver.TaskState.flush`).
    ``memo``: a dict shared by several calls: a tensor met again (however often it is referenced) gets the
    copy made the first time, so references stay references and cost no memory each."""
    if isinstance(value, torch.Tensor):
        if memo is not None:
            hit = memo.get(id(value))
            if hit is not None:
                return hit[1]
        copied, private = private_copy(value, graph)
        if memo is not None:
            memo[id(value)] = (value, private)    # (the original is kept: its id stays its own)
        if leaves is not None:
            leaves.append((path, value, private, version_of(copied)))
        return private
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return value
    if depth > policy.MAX_VALUE_DEPTH:
        return None
    if isinstance(value, torch.Size):
        return value
    if isinstance(value, tuple):
        return tuple(sanitize(v, depth + 1, leaves, path + (i,), graph, memo) for i, v in enumerate(value))
    if isinstance(value, list):
        return [sanitize(v, depth + 1, leaves, path + (i,), graph, memo) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return Record((k, sanitize(v, depth + 1, leaves, path + (k,), graph, memo)) for k, v in value.items()
                      if isinstance(k, (str, int)))
    return None


def scrub(text: str) -> str:
    """Hide memory addresses (``0x7f...``) in text that leaves the server."""
    from ...client.wire import scrub_addresses
    return scrub_addresses(text)


def release(value, depth=0):
    """What leaves submitted code (its result, emitted values): plain tensors, numbers, strings, containers;
    anything else is a ``TypeError``."""
    if isinstance(value, torch.Tensor):
        with DisableTorchFunction():
            return plain(value).detach()     # no autograd graph leaves with it (gradient requests)
    if isinstance(value, str):
        return scrub(value)
    if value is None or isinstance(value, (bool, int, float, bytes, torch.dtype)):
        return value
    if depth > policy.MAX_RESULT_DEPTH:
        raise TypeError("submitted code returned a value nested too deeply")
    if isinstance(value, torch.Size):
        return tuple(value)
    if isinstance(value, tuple):
        return tuple(release(v, depth + 1) for v in value)
    if isinstance(value, (list, set, frozenset)):
        return [release(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {release(k, depth + 1): release(v, depth + 1) for k, v in value.items()}
    raise TypeError(f"submitted code may return only tensors, numbers, strings and lists/tuples/dicts of them, "
                    f"not a {type(value).__name__}")


def check_replacement(new: torch.Tensor, old, what: str) -> torch.Tensor:
    """``new`` if it may stand in for ``old``: same shape, dtype and device, and finite."""
    if isinstance(old, torch.Tensor):
        if tuple(new.shape) != tuple(old.shape):
            raise ReplacementError(f"{what}: the replacement has shape {tuple(new.shape)}, the value has "
                             f"{tuple(old.shape)}")
        if new.dtype != old.dtype:
            raise ReplacementError(f"{what}: the replacement has dtype {new.dtype}, the value has {old.dtype}")
        if new.device != old.device:
            raise ReplacementError(f"{what}: the replacement is on {new.device}, the value on {old.device}")
    if (new.is_floating_point() or new.is_complex()) and not bool(torch.isfinite(new).all()):
        raise ReplacementError(f"{what}: the replacement holds inf or nan")
    return new


def rebuild(value, changes: dict, path=()):
    """``value`` with the leaves at the paths in ``changes`` replaced (other objects kept as they are)."""
    if path in changes:
        return changes[path]
    if not any(p[:len(path)] == path for p in changes):
        return value
    if isinstance(value, tuple):
        items = [rebuild(v, changes, path + (i,)) for i, v in enumerate(value)]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return [rebuild(v, changes, path + (i,)) for i, v in enumerate(value)]
    if isinstance(value, dict):
        new = copy.copy(value)
        for k in list(value.keys()):
            new[k] = rebuild(value[k], changes, path + (k,))
        return new
    return value


def to_model(value) -> torch.Tensor:
    """A tensor of submitted code on its way into the model (a replacement, a skip): a plain copy, checked."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"submitted code may replace hook points with tensors only, got {type(value).__name__}; "
                        "for tuple or structured outputs, edit the awaited tensors in place")
    with DisableTorchFunction():
        return check_replacement(plain(value).detach().clone(), None, "replacement")
