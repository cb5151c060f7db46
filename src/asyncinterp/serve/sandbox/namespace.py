"""What submitted code's globals hold: restricted builtins, the proxy modules its imports get, and hooks.

The import hook hands out :class:`ModuleProxy` objects holding only the
names :mod:`asyncinterp.client.policy` lists for each allowed module (torch functions wrapped
so that their results are private tensors and factories are measured before
they allocate); the builtins are the policy's list, with ``range``, ``print``,
``repr`` and ``ascii`` replaced by restricted versions. The instrumented
code also calls two hooks from here: :func:`read_unlisted` (attribute names
outside the allow-list) and :func:`text_safe` (values turned into text).
"""

from __future__ import annotations

import builtins
import inspect
import math
import threading

import torch
import torch.nn.functional as F

from ...client import policy
from .envoys import SafeEnvoy, SafePoint, gather, spawn
from .errors import refuse
from .tensors import DisableTorchFunction, PrivateTensor, adopt, check_size, nbytes, precheck, tensors_in
from .values import release


class ModuleProxy:
    """A module as submitted code sees it: only allow-listed attributes."""

    __slots__ = ("_name", "_attrs")

    def __init__(self, name, attrs):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_attrs", attrs)

    def __getattr__(self, item):
        attrs = object.__getattribute__(self, "_attrs")
        try:
            return attrs[item]
        except KeyError:
            name = object.__getattribute__(self, "_name")
            raise refuse(f"{name}.{item}") from None

    def __setattr__(self, key, value):
        raise AttributeError("modules are read-only in submitted code")

    def __dir__(self):
        return sorted(object.__getattribute__(self, "_attrs"))

    def __repr__(self):
        return f"<restricted module {object.__getattribute__(self, '_name')}>"


def read_unlisted(obj, name):
    """``obj.name`` in submitted code, for a name that is not on ``policy.ALLOWED_ATTRIBUTES``.

    Such a name can only be a submodule or hook point of the model, so only the model's
    :class:`SafeEnvoy` and :class:`SafePoint` may answer it (their own checks decide what they give);
    read from anything else, it is refused.
    """
    if type(obj) is SafeEnvoy or type(obj) is SafePoint:
        return getattr(obj, name)
    why = "it is not on the sandbox's allow-list (asyncinterp/client/policy.py)"
    if type(obj) is ModuleProxy:
        raise refuse(f"{object.__getattribute__(obj, '_name')}.{name}", why)
    raise refuse(f"attribute {name!r} of a {type(obj).__name__}",
                 f"{why}, and names outside that list are read only from the model (its submodules and hook "
                 f"points, e.g. m.model.layers). For a key of a model output or a params map, write value[{name!r}]")


def _creator(fn, name):
    """A factory without tensor inputs: what it would make is measured on the meta device first, so every
    argument form (sizes as varargs, a tuple, ``size=``, a tensor of sizes, ranges) meets the same cap."""
    def create(*args, **kwargs):
        with DisableTorchFunction():
            try:
                probe = fn(*args, **{**kwargs, "device": "meta"})
            except Exception:  # noqa: BLE001 - invalid arguments: the real call reports them
                probe = None
            if isinstance(probe, torch.Tensor):
                check_size(f"torch.{name}", nbytes(probe.shape, probe.dtype))
            out = fn(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                check_size(f"torch.{name}", nbytes(out.shape, out.dtype))
            return adopt(out)
    create.__name__ = name
    return create


def _entry(fn, name):
    """A torch function reachable from submitted code: results become private tensors."""
    if name in policy.CREATORS or name in policy.TENSOR_CREATORS:
        return _creator(fn, name)

    def call(*args, **kwargs):
        if not any(type(t) is PrivateTensor for t in tensors_in((args, kwargs))):
            # nothing private to dispatch on (only Python values): check here what __torch_function__ would
            with DisableTorchFunction():
                precheck(name, fn, args, kwargs)
                return adopt(fn(*args, **kwargs))
        return adopt(fn(*args, **kwargs))
    call.__name__ = name
    return call


class _TensorTypeMeta(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, torch.Tensor)

    def __subclasscheck__(cls, sub):
        return isinstance(sub, type) and issubclass(sub, torch.Tensor)

    def __call__(cls, *args, **kwargs):
        raise refuse("torch.Tensor(...)", "it returns uninitialised memory; use torch.zeros / torch.tensor")

    def __getattr__(cls, item):
        raise refuse(f"torch.Tensor.{item}", "call methods on tensors instead")


class _TensorType(metaclass=_TensorTypeMeta):
    """``torch.Tensor`` for submitted code: ``isinstance(x, torch.Tensor)`` only."""


_MODULES = None
_MODULES_LOCK = threading.Lock()


def _functions(mod, names) -> dict:
    return {n: _entry(getattr(mod, n), n) for n in sorted(names) if getattr(mod, n, None) is not None}


def _build_modules():
    t = {}
    for name in sorted(policy.TORCH_FUNCTIONS):
        value = getattr(torch, name, None)
        if value is not None and callable(value) and not inspect.ismodule(value):
            t[name] = _entry(value, name)
    for name in sorted(policy.TORCH_DTYPES):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            t[name] = value
    for name in sorted(policy.TORCH_VALUES - {"Tensor"}):
        if hasattr(torch, name):
            t[name] = getattr(torch, name)
    t["Tensor"] = _TensorType

    functional = ModuleProxy("torch.nn.functional", _functions(F, policy.FUNCTIONAL))
    nn = ModuleProxy("torch.nn", {"functional": functional})
    linalg = ModuleProxy("torch.linalg", _functions(torch.linalg, policy.LINALG_FUNCTIONS))
    fft = ModuleProxy("torch.fft", _functions(torch.fft, policy.FFT_FUNCTIONS))
    special = ModuleProxy("torch.special", _functions(torch.special, policy.SPECIAL_FUNCTIONS))
    from .gradients import autograd_grad
    autograd = ModuleProxy("torch.autograd", {"grad": autograd_grad})
    t.update(nn=nn, linalg=linalg, fft=fft, special=special, autograd=autograd)
    torch_proxy = ModuleProxy("torch", t)
    math_proxy = ModuleProxy("math", {n: getattr(math, n) for n in sorted(policy.MATH_NAMES) if hasattr(math, n)})

    import asyncinterp as ai
    from ..scheduling.batcher import emit

    ai_attrs = {"gather": gather, "spawn": spawn, "Future": ai.Future, "emit": lambda value: emit(release(value))}
    for name in sorted(policy.ASYNCINTERP_ERRORS):
        ai_attrs[name] = getattr(ai, name)
    serve_proxy = ModuleProxy("asyncinterp.serve", {"emit": ai_attrs["emit"]})
    ai_attrs["serve"] = serve_proxy
    return {
        "torch": torch_proxy, "torch.nn": nn, "torch.nn.functional": functional, "torch.linalg": linalg,
        "torch.fft": fft, "torch.special": special, "torch.autograd": autograd, "math": math_proxy,
        "asyncinterp": ModuleProxy("asyncinterp", ai_attrs), "asyncinterp.serve": serve_proxy,
    }


def modules() -> dict:
    """``{module name: proxy}`` for every allowed module (built once)."""
    global _MODULES
    with _MODULES_LOCK:
        if _MODULES is None:
            _MODULES = _build_modules()
        return _MODULES


def _restricted_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level:
        raise ImportError("relative imports are not allowed in submitted code")
    mods = modules()
    if name not in mods:
        raise ImportError(f"import of {name!r} is not allowed in submitted code; allowed: "
                          f"{', '.join(policy.ALLOWED_MODULES)}")
    if fromlist:
        return mods[name]
    return mods[name.split(".")[0]]


def _safe_range(*args):
    r = range(*args)
    if len(r) > policy.MAX_RANGE:
        raise ValueError(f"range of {len(r)} items exceeds the limit for submitted code ({policy.MAX_RANGE})")
    return r


def _no_print(*args, **kwargs):
    return None


def text_safe(value, depth=0):
    """Values submitted code may turn into text: their text shows no memory address."""
    if isinstance(value, policy.TEXT_SAFE_TYPES) or isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (SafeEnvoy, SafePoint)):
        return value
    if depth < policy.MAX_TEXT_DEPTH and isinstance(value, (list, tuple, set, frozenset)):
        for v in value:
            text_safe(v, depth + 1)
        return value
    if depth < policy.MAX_TEXT_DEPTH and isinstance(value, dict):
        for k, v in value.items():
            text_safe(k, depth + 1)
            text_safe(v, depth + 1)
        return value
    if depth < policy.MAX_TEXT_DEPTH and isinstance(value, BaseException):
        text_safe(value.args, depth + 1)
        return value
    raise refuse(f"turning a {type(value).__name__} into text", "its text shows a memory address")


def _safe_repr(value):
    return repr(text_safe(value))


def _safe_ascii(value):
    return ascii(text_safe(value))


_REPLACEMENTS = {"range": _safe_range, "print": _no_print, "repr": _safe_repr, "ascii": _safe_ascii,
                 "__import__": _restricted_import}


def safe_builtins() -> dict:
    """The builtins of submitted code: the policy's list as they are, and its replaced ones (a fresh map each
    time: one namespace never sees another's)."""
    global _SAFE_BUILTINS
    if _SAFE_BUILTINS is None:
        out = {n: getattr(builtins, n) for n in sorted(policy.BUILTINS) if hasattr(builtins, n)}
        out.update({n: _REPLACEMENTS[n] for n in policy.REPLACED_BUILTINS})
        _SAFE_BUILTINS = out
    return dict(_SAFE_BUILTINS)


_SAFE_BUILTINS = None
