"""The compile function a server gives :func:`~.rebuild.rebuild`: captured source runs as submitted code does.

Captured functions are submitted code with values attached, so they get
exactly the sandbox's treatment (see :mod:`.sandbox`): the static check
(:func:`~.sandbox.checker.check_source`), the instrumentation (the
request's clock ticks in every loop and call; unlisted attribute reads are
checked where they run), restricted builtins and proxy modules, and, for
the entry points, the restricted view of the model (:class:`~.sandbox.SafeEnvoy`)
driven by :class:`~.sandbox.driver.Driven`, whose results are released as
plain values. What the functions read arrives as the sandbox's private
copies (:func:`~.sandbox.sanitize`; bytes and sets, which it does not hand
to submitted code, become ``None``); futures are kept as they are (they are
the ones :func:`~.rebuild.rebuild` made, shared between invokes).

One :class:`Sandboxed` per request (it holds the request's clock); pass it
as ``compile_source`` and wrap each entry point with :meth:`Sandboxed.entry`
(``loads_job`` does this when the compile function has an ``entry``).
"""

from __future__ import annotations

import functools
import types

import torch

from ...client import policy
from ...lru import LRU
from ...kernel.futures import Future
from .checker import AST_LOCK, check_source
from .clock import Clock
from .driver import Driven
from .envoys import SafeEnvoy, setpoint
from .errors import SUBMITTED_PREFIX
from .gradients import needs_grad
from .instrumentation import MEMBER, PLAIN, SETPOINT, TICK, instrument
from .namespace import read_unlisted, safe_builtins, text_safe
from .values import release, sanitize
from .source_lines import remember

__all__ = ["Sandboxed"]


class Sandboxed:
    """Compile captured source as the sandbox compiles submitted code (``deadline``, ``budget``: see ``Clock``)."""

    def __init__(self, deadline: float | None = None, budget: float | None = None, model=None, copies: bool = True):
        self.clock = Clock(deadline, budget)
        self.model = model
        self.copying = copies   # False: a check only (the code runs elsewhere, which makes the private copies)
        self.entries = []       # entry points made so far: all run with autograd on once any source names a gradient
        self.copies = {}        # id -> (captured tensor, its private copy): one copy per tensor, however referenced

    def envoy(self, path: str):
        """A captured reference to the model's module at ``path``, as submitted code sees modules."""
        from .rebuild import DescriptionRefused, resolve
        if self.model is None:
            raise DescriptionRefused("this job refers to the model's modules, but no model was given")
        return SafeEnvoy(resolve(self.model, path), path == "")

    def __call__(self, source: str, filename: str, namespace: dict) -> None:
        code, grad = _CHECKED.get(source)
        if grad:     # a gradient request: private copies stay on the graph, autograd on in its forwards
            self.clock.grad = True
            for submitted in self.entries:
                submitted.needs_grad = True
        filename = f"{SUBMITTED_PREFIX}{filename.strip('<>')}>"   # how the sandbox's tracebacks know its frames
        remember(filename, source)
        code = _filed_as(code, filename)   # this job's own name (never another job's, which sent the same source)
        if self.copying:
            for name, value in list(namespace.items()):
                if not isinstance(value, (Future, SafeEnvoy)) and name != "__name__":
                    namespace[name] = _private(value, self.copies)
        namespace.update({"__builtins__": safe_builtins(), TICK: self.clock.tick, SETPOINT: setpoint,
                          PLAIN: text_safe, MEMBER: read_unlisted})
        exec(code, namespace)  # noqa: S102 - checked and instrumented above, restricted builtins

    def private(self, value):
        """A captured value as submitted code gets it (a private copy, one per tensor; futures as they are)."""
        if not self.copying or isinstance(value, (Future, SafeEnvoy)):
            return value
        return _private(value, self.copies)

    def entry(self, fn):
        """An entry point as the engine calls it: the model seen through ``SafeEnvoy``, results released."""
        if isinstance(fn, functools.partial):
            fn = functools.partial(fn.func, *fn.args, **{k: self.private(v) for k, v in fn.keywords.items()})
        clock = self.clock
        name = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", "captured")

        async def submitted(m):
            return release(await Driven(fn(SafeEnvoy(m)), clock))

        submitted.__qualname__ = submitted.__name__ = name
        submitted.sandboxed = True   # submitted code (a server puts it in its code worker pool)
        submitted.needs_grad = clock.grad
        self.entries.append(submitted)
        return submitted


class _CheckedSources:
    """Checked, instrumented and compiled sources by their text: a sweep that sends the same function again and
    again is checked once (per process), not on every request. Bounded by count and by total source size."""

    def __init__(self, size: int = policy.PROGRAM_CACHE_SIZE, max_bytes: int = 16 << 20):
        self.items = LRU(size, max_weight=max_bytes, weigh=lambda source, _: len(source))

    def get(self, source: str):
        """``(code, needs_grad)`` of ``source``: raises what :func:`check_source` raises for a refused one."""
        hit = self.items.get(source)
        if hit is None:
            tree = check_source(source)
            grad = needs_grad(tree)
            with AST_LOCK:
                code = compile(instrument(tree), _UNFILED, "exec")
            hit = self.items.put(source, (code, grad))
        return hit


_UNFILED = "<submitted, not yet filed>"
_CHECKED = _CheckedSources()


def _filed_as(code, filename: str):
    """``code`` (and the functions defined in it) under ``filename``, for its tracebacks and linecache."""
    consts = tuple(_filed_as(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def _private(value, memo=None):
    if isinstance(value, (torch.Tensor, list, tuple, dict)):
        return sanitize(value, memo=memo)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return None
