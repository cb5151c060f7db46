"""Private tensors: the only kind of tensor submitted code holds.

A :class:`PrivateTensor` is a copy of the request's own data whose
``__torch_function__`` lets through only the operations the policy lists,
checks index bounds, and measures every result on meta tensors against
:data:`~asyncinterp.client.policy.MAX_TENSOR_BYTES` before it is made. This module also turns
server tensors into private copies and back.
"""

from __future__ import annotations

import contextlib

import torch

from ...client import policy
from .errors import SandboxRefused, refuse, user_line
from .operations import ALLOWED_OPS

DisableTorchFunction = torch._C.DisableTorchFunctionSubclass   # the documented way to call through


def nbytes(shape, dtype) -> int:
    n = 1
    for d in shape:
        n *= max(int(d), 0)
    return n * (dtype.itemsize if dtype is not None else 4)


def check_size(what: str, size: int) -> None:
    if size > policy.MAX_TENSOR_BYTES:
        raise SandboxRefused(f"{what} would make a tensor of {size} bytes, which exceeds the limit for "
                             f"submitted code ({policy.MAX_TENSOR_BYTES} bytes) ({user_line()})")


def _to_meta(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
        return type(x)(_to_meta(v) for v in x) if type(x) in (list, tuple) else x
    return x


def tensors_in(x):
    """The tensors in ``x`` and in the lists, tuples and dicts it holds."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from tensors_in(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from tensors_in(v)


def _index_bounds(name, args, kwargs):
    """Index tensors of gather/scatter/index_* must lie inside the indexed dimension (also on GPUs, whose
    kernels do not check: an out-of-range index there is a device assert that kills every request)."""
    if name not in policy.INDEX_CHECKED:
        return
    if name in ("take", "put_"):       # flat indices into the whole tensor
        src, idx = (args + (None, None))[:2]
        if not isinstance(src, torch.Tensor) or not isinstance(idx, torch.Tensor) or idx.numel() == 0:
            return
        size = src.numel()
    else:                              # (src, dim, index), or take_along_dim's (src, index, dim)
        if len(args) < 2:
            return
        src = args[0]
        dim = args[1] if name != "take_along_dim" else (args[2] if len(args) > 2 else kwargs.get("dim"))
        idx = args[1] if name == "take_along_dim" else args[2] if len(args) > 2 else None
        idx = kwargs.get("index", idx)
        if not isinstance(src, torch.Tensor) or not isinstance(idx, torch.Tensor) or idx.numel() == 0:
            return
        size = src.numel() if dim is None else src.shape[int(dim)] if src.dim() else 1
    with DisableTorchFunction():
        lo, hi = int(idx.min()), int(idx.max())
    if lo < -size or hi >= size:
        raise IndexError(f"{name}: index {hi if hi >= size else lo} is out of range for a dimension of size {size} "
                         f"({user_line()})")


def _data_dependent_check(name, args, kwargs):
    if name == "bincount" and args and isinstance(args[0], torch.Tensor) and args[0].numel():
        with DisableTorchFunction():
            top = int(args[0].max())
        n = max(top + 1, int(kwargs.get("minlength", args[2] if len(args) > 2 else 0) or 0))
        check_size("bincount", nbytes((n,), torch.float64))
    elif name == "repeat_interleave" and args and isinstance(args[0], torch.Tensor):
        reps = args[1] if len(args) > 1 else kwargs.get("repeats")
        src = args[0]
        if isinstance(reps, torch.Tensor):
            with DisableTorchFunction():
                total = int(reps.sum()) if reps.numel() else 0
            if reps.numel() == 1:
                total = total * src.numel()
            else:
                total = total * max(src.numel() // max(reps.numel(), 1), 1)
        elif isinstance(reps, int):
            total = reps * src.numel()
        else:
            return
        check_size("repeat_interleave", total * src.element_size())


def _basic_index(index) -> bool:
    """Whether ``index`` selects a view (ints, slices, ``None``, ``...``): never more elements than indexed."""
    if isinstance(index, tuple):
        return all(_basic_index(i) for i in index)
    return index is None or index is Ellipsis or isinstance(index, (int, slice))


def _bounded(name, args, kwargs) -> bool:
    """Whether the result cannot be larger than ``args[0]``, itself within the cap (no meta run needed)."""
    if not args or type(args[0]) is not PrivateTensor:
        return False
    if name == "__getitem__" or name == "__setitem__":   # a view of it, or a write into a view of it (in place)
        if len(args) != (2 if name == "__getitem__" else 3) or kwargs or not _basic_index(args[1]):
            return False
    elif name not in policy.SIZE_KEEPING or "dtype" in kwargs or "out" in kwargs \
            or any(isinstance(a, (torch.Tensor, torch.dtype)) for a in args[1:]):
        return False
    t = args[0]
    return nbytes(t.shape, t.dtype) <= policy.MAX_TENSOR_BYTES


def precheck(name, func, args, kwargs):
    """Before an allowed operation runs: index bounds, and the size of what it makes (on meta tensors, unless
    it is bounded by its input, :func:`_bounded`)."""
    if name in policy.NO_ALLOC or _bounded(name, args, kwargs):
        return
    _index_bounds(name, args, kwargs)
    if name in policy.DATA_DEPENDENT:
        _data_dependent_check(name, args, kwargs)
        return
    try:
        out = func(*_to_meta(args), **{k: _to_meta(v) for k, v in kwargs.items()})
    except Exception:  # noqa: BLE001 - no meta kernel, or invalid arguments: the real call reports those
        return
    for t in tensors_in(out):
        check_size(name, nbytes(t.shape, t.dtype))


class PrivateTensor(torch.Tensor):
    """The only kind of tensor submitted code holds: its own memory, and allow-listed operations only.

    Every method, operator, property and torch function that sees one of
    these goes through :meth:`__torch_function__`, which refuses operations
    outside the allow-list (naming the user's line), refuses results larger
    than the size cap before they are allocated, and keeps results private.
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = ALLOWED_OPS.get(func)
        if name is None:
            label = getattr(func, "__name__", repr(func))
            if label == "__get__":
                label = getattr(getattr(func, "__self__", None), "__name__", label)
            raise refuse(f"tensor operation {label!r}")
        with DisableTorchFunction():
            precheck(name, func, args, kwargs)
            ret = func(*args, **kwargs)
            if name in ("__iter__", "__reversed__"):
                return iter([adopt(v) for v in ret])
            return adopt(ret)


def adopt(value):
    """Results of allowed operations: plain tensors become :class:`PrivateTensor` (same memory, no copy)."""
    if isinstance(value, torch.Tensor):
        if type(value) is PrivateTensor:
            return value
        with DisableTorchFunction():
            return value.as_subclass(PrivateTensor)
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        items = [adopt(v) for v in value]
        if type(value) in (list, tuple):
            return type(value)(items)
        try:
            return type(value)(items)         # torch.return_types (values, indices)
        except TypeError:
            return tuple(items)
    return value


def plain(t: torch.Tensor) -> torch.Tensor:
    """The same memory as an ordinary tensor (server side only)."""
    with DisableTorchFunction():
        return t.as_subclass(torch.Tensor)


def private_copy(t: torch.Tensor, graph: bool = False):
    """``(plain, private)``: a fresh copy of ``t`` and its :class:`PrivateTensor` face (same memory).

    The copy is an ordinary tensor even when the model runs under ``torch.inference_mode`` (vLLM):
    inference tensors have no version counter, which is how in-place edits of the copy are detected.
    With ``graph`` (a gradient request in a forward pass with autograd on, see :mod:`.gradients`) the copy
    of a tensor that requires grad stays connected to the graph (the model then continues with it, see
    :meth:`.driver.TaskState.flush`); otherwise it is detached.
    """
    with DisableTorchFunction(), (torch.inference_mode(False) if torch.is_inference_mode_enabled() else _NOTHING):
        src = t if type(t) is torch.Tensor else plain(t)
        copy = src.clone() if graph and src.requires_grad and torch.is_grad_enabled() else _detached_copy(src)
        return copy, copy.as_subclass(PrivateTensor)


_NOTHING = contextlib.nullcontext()


_LAZY_CLONE = getattr(torch, "_lazy_clone", None)


def _detached_copy(src: torch.Tensor) -> torch.Tensor:
    """A copy of ``src``, off the graph.

    Copy-on-write where it may be: the copy shares the model's memory until either side writes to it, so reading
    an awaited value (the usual case) copies nothing, and the first in-place write of either side copies then.
    It may be where that memory is at most twice what ``src`` shows (a request alone in its forward, or half of
    a two-row one), so that what submitted code keeps never holds much more than its own rows alive. An
    ordinary copy otherwise: for inference tensors (they have no version counter), for memory torch cannot share,
    and off the CPU (where a copy costs little, and a copy made later, when a side writes, would be made outside
    the stream that writes).
    """
    src = src.detach()
    if _LAZY_CLONE is not None and src.device.type == "cpu" and not src.is_inference() \
            and src.untyped_storage().nbytes() <= 2 * src.numel() * src.element_size():
        try:
            return _LAZY_CLONE(src)
        except RuntimeError:
            pass
    return src.clone()


def version_of(t: torch.Tensor) -> int:
    """The in-place version counter of ``t`` (shared by its views)."""
    with DisableTorchFunction():
        return t._version
