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

How it works: a scan is a job of kind ``"trace"`` handed to a
:class:`ScanEngine`, which wraps the model's own engine: the run it starts is
the model's usual run (language models pad and slice as always); only the
forward (and the intervention code resumed inside it) sees fake tensors.

Limits: code that needs real values (``.item()``, data-dependent control
flow) fails under fake tensors with torch's own error; generation is not
scanned (a scan is one forward pass).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..hooks.views import map_tensors
from ..job import Trace, is_async_fn
from ..moved import old_name
from .cache import Cache, KeyNode

__all__ = ["FakeExecution", "ScanEngine", "ShapeInfo", "Shapes", "scan", "scan_run", "fake_mode"]


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


class ScanEngine:
    """Runs jobs on another engine's runs with fake tensors: ``ScanEngine(model.engine("trace"))``."""

    def __init__(self, engine):
        self.engine = engine
        self.model = engine.model

    def make_invoke(self, index, input, fns, kwargs, deferred):
        return self.engine.make_invoke(index, input, fns, kwargs, deferred)

    def start(self, job) -> "FakeExecution":
        return FakeExecution(self.engine.start(job))


class FakeExecution:
    """A started run whose forward runs under :func:`fake_mode`; the interventions start and finish as usual."""

    def __init__(self, run):
        self.run = run

    def wait(self, cancellable: bool = False) -> None:
        self.run.wait(cancellable, around=_faked)

    def cancel(self) -> None:
        self.run.cancel()

    def cancel_invoke(self, index) -> None:
        self.run.cancel_invoke(index)

    def __getattr__(self, name):   # done, output, stopped, layout: the run's
        return getattr(self.run, name)


def __getattr__(name):   # old names (FakeForward): the compatibility table, asyncinterp.moved.RENAMED
    return old_name(__name__, name)


def scan_run(model, on_error: str = "stop") -> Trace:
    """A job of ``model`` being built, to be run on the model's own engine with fake tensors."""
    return Trace(model, "trace", on_error, engine=ScanEngine(model.engine("trace")))


def _faked(forward):
    def fake_forward():
        with fake_mode():
            return forward()
    return fake_forward


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
    tr = scan_run(model)
    inv = tr.invoke(input, fn, **kwargs)
    tr.run()
    result = inv.result
    if cache is None:
        return result
    out = Shapes()
    for key in cache.keys():
        values = cache.all(key)
        out[key] = map_tensors(_info, values[0]) if len(values) == 1 else [map_tensors(_info, v) for v in values]
    return out
