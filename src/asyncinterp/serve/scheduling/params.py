"""Typed parameters of registered interventions (``Annotated[float, Range(-20, 20)]``, ``ModulePath``, ...).

Shared by the server (:mod:`.app`), the built-in interventions
(:mod:`.builtins`) and anything that registers interventions; it imports
none of them. ``asyncinterp.serve.Param``/``Range`` and
``asyncinterp.serve.http.app.Range``/``ModulePath`` name the same classes.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing

import torch

__all__ = ["BadRequest", "MaxLen", "ModulePath", "Param", "Range", "Registered", "short_repr"]

# --------------------------------------------------------------------------- typed parameters
class Range:
    """``Annotated[float, Range(lo, hi)]``: an inclusive numeric range for a parameter."""

    def __init__(self, lo=None, hi=None):
        self.lo, self.hi = lo, hi

    def check(self, name, value):
        if self.lo is not None and value < self.lo or self.hi is not None and value > self.hi:
            raise BadRequest(f"parameter {name!r} must be in [{self.lo}, {self.hi}], got {value!r}")

    def describe(self):
        return {"min": self.lo, "max": self.hi}


class MaxLen:
    """``Annotated[str, MaxLen(n)]`` / ``Annotated[list[int], MaxLen(n)]``: a length limit."""

    def __init__(self, n: int):
        self.n = n

    def check(self, name, value):
        if len(value) > self.n:
            raise BadRequest(f"parameter {name!r} is longer than {self.n}")

    def describe(self):
        return {"max_len": self.n}


class ModulePath(str):
    """A parameter naming a module of the served model (``"model.layers.3"``); checked against the model."""


class BadRequest(ValueError):
    """A request the server refuses before any model work (HTTP 400)."""


_MAX_LIST = 1 << 16
_MAX_STR = 1 << 16


class Param:
    """One typed parameter of a registered intervention (built from the function's signature)."""

    def __init__(self, name, annotation, default):
        self.name = name
        self.default = default
        self.required = default is inspect.Parameter.empty
        self.checks = []
        if typing.get_origin(annotation) is typing.Annotated:
            args = typing.get_args(annotation)
            annotation = args[0]
            self.checks = [a for a in args[1:] if hasattr(a, "check")]
        self.optional = False
        origin = typing.get_origin(annotation)
        if origin in (typing.Union, getattr(types, "UnionType", None)):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(args) != 1 or len(typing.get_args(annotation)) != 2:
                raise TypeError(f"parameter {name!r}: only Optional[X] unions are supported")
            self.optional = True
            annotation = args[0]
            origin = typing.get_origin(annotation)
        self.type = annotation
        self.origin = origin
        if origin is typing.Literal:
            self.choices = typing.get_args(annotation)
        elif origin in (list, tuple):
            (item,) = typing.get_args(annotation)[:1] or (None,)
            if item not in (int, float, str, bool):
                raise TypeError(f"parameter {name!r}: lists must be of int, float, str or bool")
            self.item = item
        elif annotation not in (int, float, str, bool, torch.Tensor, ModulePath):
            raise TypeError(f"parameter {name!r} has unsupported type {annotation!r}; use int, float, bool, str, "
                            "torch.Tensor, ModulePath, list[int|float|str|bool], Literal[...], Optional[...], "
                            "optionally Annotated with Range/MaxLen")

    def describe(self) -> dict:
        t = self.type
        if self.origin is typing.Literal:
            kind = {"type": "literal", "choices": list(self.choices)}
        elif self.origin in (list, tuple):
            kind = {"type": f"list[{self.item.__name__}]"}
        elif t is torch.Tensor:
            kind = {"type": "tensor"}
        elif t is ModulePath:
            kind = {"type": "module_path"}
        else:
            kind = {"type": t.__name__}
        out = dict(kind, required=self.required, optional=self.optional)
        if not self.required and isinstance(self.default, (int, float, str, bool, type(None))):
            out["default"] = self.default
        for c in self.checks:
            out.update(c.describe())
        return out

    def validate(self, value, model):
        name = self.name
        if value is None and self.optional:
            return None
        t = self.type
        if self.origin is typing.Literal:
            if value not in self.choices or type(value) is bool and not any(c is value for c in self.choices):
                raise BadRequest(f"parameter {name!r} must be one of {list(self.choices)}, got {short_repr(value)}")
        elif self.origin in (list, tuple):
            if not isinstance(value, (list, tuple)) or len(value) > _MAX_LIST:
                raise BadRequest(f"parameter {name!r} must be a list of {self.item.__name__}")
            value = [_scalar(name, self.item, v) for v in value]
        elif t is torch.Tensor:
            if not isinstance(value, torch.Tensor):
                raise BadRequest(f"parameter {name!r} must be a tensor, got {type(value).__name__}")
        elif t is ModulePath:
            if not isinstance(value, str) or len(value) > 512:
                raise BadRequest(f"parameter {name!r} must be a module path (a string)")
            if value not in _module_paths(model):
                raise BadRequest(f"parameter {name!r}: the model has no module {value!r} (see GET /v1/model)")
            value = ModulePath(value)
        else:
            value = _scalar(name, t, value)
        for c in self.checks:
            c.check(name, value)
        return value


def _scalar(name, t, value):
    if t is bool:
        if type(value) is not bool:
            raise BadRequest(f"parameter {name!r} must be a bool, got {short_repr(value)}")
        return value
    if t is int:
        if type(value) is not int:
            raise BadRequest(f"parameter {name!r} must be an int, got {short_repr(value)}")
        return value
    if t is float:
        if type(value) not in (int, float):
            raise BadRequest(f"parameter {name!r} must be a number, got {short_repr(value)}")
        value = float(value)
        if value != value or value in (float("inf"), float("-inf")):
            raise BadRequest(f"parameter {name!r} must be finite")
        return value
    if t is str:
        if type(value) is not str or len(value) > _MAX_STR:
            raise BadRequest(f"parameter {name!r} must be a string (at most {_MAX_STR} characters)")
        return value
    raise BadRequest(f"parameter {name!r} has an unsupported type")  # pragma: no cover


def short_repr(value, n=60):
    """``repr(value)``, cut to ``n`` characters (for error messages)."""
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


@functools.lru_cache(maxsize=8)
def _paths_of(module_id, module):
    return frozenset(name for name, _ in module.named_modules() if name)


def _module_paths(model):
    module = model.module
    return _paths_of(id(module), module)


class Registered:
    """A server-registered intervention: the function and its typed parameters."""

    def __init__(self, name, fn, doc=None):
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"intervention {name!r} must be an `async def` taking the model envoy first")
        sig = inspect.signature(fn)
        params = list(sig.parameters.values())
        if not params:
            raise TypeError(f"intervention {name!r} must take the model envoy as its first argument")
        hints = typing.get_type_hints(fn, include_extras=True)
        self.params = {}
        for p in params[1:]:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(f"intervention {name!r}: *args/**kwargs are not allowed (parameters are typed)")
            if p.name not in hints:
                raise TypeError(f"intervention {name!r}: parameter {p.name!r} needs a type annotation")
            self.params[p.name] = Param(p.name, hints[p.name], p.default)
        self.name = name
        self.fn = fn
        self.doc = doc or inspect.getdoc(fn) or ""

    def bind(self, params, model):
        if not isinstance(params, dict):
            raise BadRequest("params must be a map")
        unknown = [k for k in params if k not in self.params]
        if unknown:
            raise BadRequest(f"intervention {self.name!r} has no parameter(s) {[short_repr(k) for k in unknown]}; "
                             f"it takes {sorted(self.params)}")
        values = {}
        for pname, p in self.params.items():
            if pname in params:
                values[pname] = p.validate(params[pname], model)
            elif p.required:
                raise BadRequest(f"intervention {self.name!r} needs parameter {pname!r}")
        fn = self.fn

        async def bound(m):
            return await fn(m, **values)

        bound.__name__ = bound.__qualname__ = self.name
        return bound

    def describe(self):
        return {"doc": self.doc, "params": {k: p.describe() for k, p in self.params.items()}}
