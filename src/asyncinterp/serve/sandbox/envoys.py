"""The model as submitted code sees it: :class:`SafeEnvoy` and :class:`SafePoint`.

Submodules, standard names, hook points (await, replace, assign), ``skip``,
ad-hoc calls and, on the model itself, ``steps``/``stop``/``generated`` —
not the ``nn.Module``, its parameters or its methods. Awaited values,
``gather``/``spawn`` results and ad-hoc call results are private copies of
the request's own rows; explicit replacements travel into the model as
checked copies. Attribute names that are not on the policy's allow-list are
answered only by these two classes (see :func:`.namespace.read_unlisted`).
"""

from __future__ import annotations

import inspect

import torch

from ...hooks.envoy import Envoy, point as point_descriptor
from ...hooks.modules import submodules
from ...hooks.points import Point
from ...client import policy
from .driver import Driven, Pending, current_state
from .gradients import SafeGradPoint, backward_of
from .tensors import plain
from .values import Record, check_replacement, sanitize, to_model


class SafePoint:
    """A hook point for submitted code: awaitable (a private copy), replaceable (by a tensor), nothing else."""

    __slots__ = ("_point",)

    def __init__(self, point):
        object.__setattr__(self, "_point", point)

    def __await__(self):
        point = object.__getattribute__(self, "_point")
        raw = yield from point.__await__()
        leaves = []
        state = current_state()
        graph = bool(state is not None and getattr(state.clock, "grad", False) and torch.is_grad_enabled())
        value = sanitize(raw, leaves=leaves, graph=graph)
        if state is not None and leaves:
            state.pending.append(Pending(point, raw, leaves))
        return value

    def replace(self, value, *, shape_change: bool = False, dtype_change: bool = False):
        point = object.__getattribute__(self, "_point")
        new = to_model(value)
        state = current_state()
        old = state.forget(point) if state is not None else None
        if isinstance(old, torch.Tensor) and not (shape_change or dtype_change):
            check_replacement(new, old, f"replacement of {point.describe()}")
        if shape_change or dtype_change:   # the opt-ins of a local run; the run checks them as it does there
            return point.replace(new, shape_change=bool(shape_change), dtype_change=bool(dtype_change))
        return point.replace(new)

    set = replace

    @property
    def grad(self):
        """The gradient at this point, in this request's own backward passes (see :mod:`.gradients`)."""
        return SafeGradPoint(SafePoint(object.__getattribute__(self, "_point").grad))

    def __getattr__(self, item):
        raise AttributeError("hook points offer only await, .replace(value), .set(value) and .grad to submitted "
                             "code")

    def __setattr__(self, key, value):
        raise AttributeError("hook points are read-only")

    def __repr__(self):
        return repr(object.__getattribute__(self, "_point"))


def _standard(envoy, name):
    """A standard name below ``envoy`` for submitted code: an alias (``layers``, ``attn``, ``mlp``) as a
    :class:`SafeEnvoy`, a semantic point (``resid_mid``, ``attn.q``, ``logits``) as a :class:`SafePoint`;
    ``None`` for anything else (module attributes, parameters and buffers stay out of reach)."""
    found = envoy.standard_name(name)
    if isinstance(found, Envoy):
        return SafeEnvoy(found, False)
    if isinstance(found, Point):
        return SafePoint(found)
    return None


_POINT_NAMES = {}   # envoy class -> the names of the hook points it declares (classes are few)


class SafeEnvoy:
    """The model as submitted code sees it: submodules, hook points, skip, ad-hoc calls; no parameters."""

    __slots__ = ("_envoy", "_root")

    def __init__(self, envoy, root=True):
        object.__setattr__(self, "_envoy", envoy)
        object.__setattr__(self, "_root", root)

    def _points(self):
        """The hook point names the envoy's class declares (worked out once per class)."""
        cls = type(object.__getattribute__(self, "_envoy"))
        names = _POINT_NAMES.get(cls)
        if names is None:
            names = _POINT_NAMES[cls] = frozenset(
                name for k in cls.__mro__ for name, v in vars(k).items() if isinstance(v, point_descriptor))
        return names

    def __getattr__(self, name):
        envoy = object.__getattribute__(self, "_envoy")
        root = object.__getattribute__(self, "_root")
        if name.startswith(policy.PRIVATE_ATTRIBUTE):
            raise AttributeError(name)
        if name in submodules(envoy.module):
            return SafeEnvoy(envoy.child(name), False)
        if name in self._points():
            return SafePoint(getattr(envoy, name))
        found = _standard(envoy, name)
        if found is not None:
            return found
        if name in policy.ENVOY_ATTRIBUTES or (root and name in policy.ROOT_ATTRIBUTES):
            return _envoy_attribute(envoy, name)
        raise AttributeError(
            f"{envoy.path or 'the model'} has no submodule or hook point {name!r} available to submitted code "
            f"(submodules: {', '.join(list(submodules(envoy.module))[:12]) or 'none'})")

    def __setattr__(self, name, value):
        envoy = object.__getattribute__(self, "_envoy")
        if name in self._points():
            SafePoint(getattr(envoy, name)).replace(value)
            return
        found = _standard(envoy, name)
        if isinstance(found, SafePoint):    # a semantic point: m.layers[1].resid_post = h
            found.replace(value)
            return
        raise AttributeError(f"cannot set {name!r}: only hook points can be assigned")

    def __getitem__(self, index):
        envoy = object.__getattribute__(self, "_envoy")
        got = envoy[index]
        if isinstance(got, list):
            return [SafeEnvoy(e, False) for e in got]
        return SafeEnvoy(got, False)

    def __len__(self):
        return len(object.__getattribute__(self, "_envoy"))

    def __iter__(self):
        for e in object.__getattribute__(self, "_envoy"):
            yield SafeEnvoy(e, False)

    def __call__(self, *args, **kwargs):
        """An ad-hoc call on the caller's own tensors; the answer is a private copy (other objects: None)."""
        def inward(x, depth=0):
            if isinstance(x, torch.Tensor):
                return plain(x).detach().clone()
            if isinstance(x, (list, tuple)) and depth < policy.MAX_CALL_DEPTH:
                return type(x)(inward(v, depth + 1) for v in x) if type(x) in (list, tuple) else x
            if isinstance(x, (SafeEnvoy, SafePoint)) or callable(x):
                raise TypeError("ad-hoc module calls take tensors, numbers and strings")
            return x
        envoy = object.__getattribute__(self, "_envoy")
        out = envoy(*[inward(a) for a in args], **{k: inward(v) for k, v in kwargs.items()})
        return sanitize(out)

    def __repr__(self):
        return repr(object.__getattribute__(self, "_envoy"))


def _envoy_attribute(envoy, name):
    """``path``, ``skip`` and, on the model, ``steps``, ``stop`` and ``generated``, as submitted code gets them."""
    if name == "path":
        return envoy.path
    if name == "skip":
        def skip(value):
            return envoy.skip(to_model(value))
        return skip
    if name == "at":
        def at(path):
            """``m.at("blocks.3.hook_resid_post")``: each part read as submitted code reads attributes."""
            if not isinstance(path, str) or not path:
                raise TypeError(f"a point path is a non-empty dotted string, got {path!r}")
            here = SafeEnvoy(envoy, envoy.parent is None)
            for part in path.split("."):
                if not isinstance(here, SafeEnvoy):
                    raise AttributeError(f"{path!r}: {part!r} follows a hook point")
                here = getattr(here, part)
            if isinstance(here, SafeEnvoy) and part.startswith("hook_"):
                here = here.output        # a hook name names a value (a real HookPoint module: its output)
            return here
        return at
    if name == "generated":
        g = envoy.generated
        return Record(tokens=sanitize(g.tokens), text=g.text)
    if name == "backward":
        return backward_of(envoy)
    return getattr(envoy, name)     # steps, stop; a language model's decode, to_tokens, token_id


def setpoint(obj, name, value):
    """``obj.name = value`` in submitted code: only hook points of the model envoy may be assigned."""
    if isinstance(obj, SafePoint) and name == "grad":     # m.x.output.grad = g
        obj.grad.replace(value)
        return
    if not isinstance(obj, SafeEnvoy):
        raise AttributeError(f"cannot assign {name!r} here: submitted code may only assign hook points of the "
                             f"model (`m.layer.{name} = value`)")
    setattr(obj, name, value)


async def _await_point(point):
    return await point


def _as_coro(aw):
    if isinstance(aw, (SafePoint, SafeGradPoint)) or inspect.iscoroutine(aw):
        state = current_state()   # the submitted task calling spawn/gather: its request's clock
        clock = state.clock if state is not None else None

        async def run():
            return await Driven(aw if inspect.iscoroutine(aw) else _await_point(aw), clock)
        return run()
    return aw


def spawn(coro, name=None):
    """``ai.spawn`` for submitted code: the sub-task is driven (timed, edits written back) like its caller."""
    import asyncinterp as ai
    return ai.spawn(_as_coro(coro), name)


async def gather(*awaitables):
    """``ai.gather`` for submitted code: each awaitable is driven like its caller; results are private copies."""
    import asyncinterp as ai
    return await ai.gather(*[_as_coro(a) for a in awaitables])
