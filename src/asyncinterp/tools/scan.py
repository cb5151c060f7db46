"""Scan: shapes and dtypes of hook points without running the real computation.

``model.scan(x)`` runs one forward pass under torch's ``FakeTensorMode``:
every tensor is a fake tensor that carries shape, dtype and device but no
data, so nothing is computed (a large model scans in milliseconds per
layer) and a model built on the ``meta`` device (no weights loaded yet)
scans too. It returns a :class:`Shapes` table of the points the filters
select (the same filters as :class:`~asyncinterp.tools.cache.Cache`)::

    shapes = model.scan(x, "model.layers.*", inputs=True)
    print(shapes)                              # one line per point
    shapes["model.layers.3.output"].shape      # torch.Size([...])

``model.scan(x, fn)`` runs an intervention the same way and returns its
result: the intervention sees fake tensors, so it can check shapes, build
replacements of the right shape and find mistakes (out-of-order awaits,
wrong replacement shapes) before a real run::

    async def check(m):
        h = await m.model.layers[3].output
        return h.shape
    model.scan(x, check)

Limits: code that needs real values (``.item()``, data-dependent control
flow) fails under fake tensors with torch's own error; generation is not
scanned (a scan is one forward pass).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from ..kernel.task import is_async_fn
from .cache import Cache, KeyNode
from ..hooks.views import map_tensors

__all__ = ["FakeForward", "ShapeInfo", "Shapes", "scan", "scan_run", "fake_mode"]


class ShapeInfo(NamedTuple):
    """Shape, dtype and device of one tensor seen during a scan."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    def __repr__(self):
        return f"{tuple(self.shape)} {str(self.dtype).replace('torch.', '')}"


class Shapes(dict):
    """``{point key: ShapeInfo (or a structure of them)}`` in the order the points fired."""

    def __repr__(self):
        if not self:
            return "<ai.Shapes (empty)>"
        width = max(len(k) for k in self)
        return "\n".join(f"{k:<{width}}  {_fmt(v)}" for k, v in self.items())

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return KeyNode(self, name, "scan")


def _fmt(v):
    if isinstance(v, ShapeInfo):
        return repr(v)
    if isinstance(v, (tuple, list)):
        return "(" + ", ".join(_fmt(x) for x in v) + ")"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items()) + "}"
    return type(v).__name__ if v is not None else "None"


def fake_mode():
    """A ``FakeTensorMode`` that also accepts real tensors (weights, inputs) and fakes them on use."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    return FakeTensorMode(allow_non_fake_inputs=True)


def _info(t):
    return ShapeInfo(t.shape, t.dtype, t.device)


class FakeForward:
    """Mixin for a run class: the run's forward pass runs under :func:`fake_mode`.

    It overrides the run's public ``execute(forward)``: the interventions start,
    hook and finish as in any run; only the forward (and the intervention code
    resumed inside it) sees fake tensors.
    """

    def execute(self, forward) -> None:
        def fake_forward():
            with fake_mode():
                return forward()
        super().execute(fake_forward)


_scan_classes = weakref.WeakKeyDictionary()   # run class -> its FakeForward subclass


def scan_run(model, **options):
    """A run of ``model`` (of the class ``model.new_run`` makes) whose forward runs with fake tensors."""
    base = type(model.new_run(**options))
    cls = _scan_classes.get(base)
    if cls is None:
        cls = _scan_classes[base] = type(f"Scan{base.__name__}", (FakeForward, base), {})
    return cls(model, **options)


def scan(model, input, fn=None, modules=None, *, outputs: bool = True, inputs: bool = False, points=None,
         include_root: bool = False, **kwargs):
    """Run ``model`` on ``input`` with fake tensors (see module docs).

    With ``fn`` (an ``async def fn(m)``): returns what ``fn`` returns.
    Without: returns a :class:`Shapes` table of the points ``modules``,
    ``outputs``/``inputs``/``points`` select. A string or list as the second
    positional argument is taken as the module filter.
    """
    if fn is not None and not is_async_fn(fn):
        if modules is not None:
            raise TypeError(f"scan(model, input, fn, modules): fn must be an `async def fn(m)`, got {fn!r}")
        fn, modules = None, fn  # scan(model, x, "layers.*"): a filter, not an intervention
    cache = None
    if fn is None:
        cache = Cache(modules, outputs=outputs, inputs=inputs, points=points, detach=True,
                      include_root=include_root)
        fn = cache
    run = scan_run(model)
    inv = run.invoke(input, fn, **kwargs)
    run.run()
    result = inv.result
    if cache is None:
        return result
    out = Shapes()
    for key in cache.keys():
        values = cache.all(key)
        out[key] = map_tensors(_info, values[0]) if len(values) == 1 else [map_tensors(_info, v) for v in values]
    return out
