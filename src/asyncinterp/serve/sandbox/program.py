"""Compiled submitted programs: checked and instrumented once, bound to a fresh namespace per request.

:class:`Program` runs the static check, finds the entry point and its
parameters, and compiles the instrumented tree; :meth:`Program.bind` makes
one request's intervention from it (restricted builtins, proxy modules, the
hooks the instrumentation calls, the request's clock).
:class:`ProgramCache` keeps compiled programs by source.
"""

from __future__ import annotations

import ast
import hashlib
import linecache

import torch

from ...client import policy
from ...lru import LRU
from .checker import AST_LOCK, check_source
from .clock import Clock
from .driver import Driven
from .envoys import SafeEnvoy, setpoint
from .errors import SUBMITTED_PREFIX, SandboxRefused
from .gradients import needs_grad
from .instrumentation import MEMBER, PLAIN, SETPOINT, TICK, instrument
from .namespace import read_unlisted, safe_builtins, text_safe
from .values import release, sanitize


class Program:
    """Checked, instrumented, compiled source; :meth:`bind` makes a fresh intervention per request."""

    def __init__(self, source: str, entry: str | None = None):
        tree = check_source(source)
        asyncs = [s.name for s in tree.body if isinstance(s, ast.AsyncFunctionDef)]
        if entry is None:
            if len(asyncs) != 1:
                raise SandboxRefused(
                    "submitted code must define exactly one top-level `async def` (or name the entry point); "
                    f"found {asyncs or 'none'}")
            entry = asyncs[0]
        elif entry not in asyncs:
            raise SandboxRefused(f"entry point {entry!r} is not a top-level `async def` in the submitted code "
                                 f"(found {asyncs or 'none'})")
        self.entry = entry
        fn_node = next(s for s in tree.body if isinstance(s, ast.AsyncFunctionDef) and s.name == entry)
        a = fn_node.args
        if not (a.posonlyargs + a.args):
            raise SandboxRefused(f"{entry} must take the model as its first argument: `async def {entry}(m, ...)`")
        rest = (a.posonlyargs + a.args)[1:]
        n_def = len(a.defaults)
        positional = [p.arg for p in rest]
        self.required = set(positional[:max(len(positional) - n_def, 0)])   # those without a default
        self.required |= {k.arg for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is None}
        self.params = set(positional) | {k.arg for k in a.kwonlyargs}
        self.var_kw = a.kwarg is not None
        digest = hashlib.sha256(source.encode()).hexdigest()[:12]
        self.filename = f"{SUBMITTED_PREFIX}{entry}:{digest}>"
        self.source = source
        self.needs_grad = needs_grad(tree)    # it names a gradient: it runs in forward passes with autograd on
        with AST_LOCK:
            self.code = compile(instrument(tree), self.filename, "exec")
        linecache.cache[self.filename] = (len(source), None, source.splitlines(True), self.filename)

    def check_params(self, params: dict) -> None:
        if not isinstance(params, dict):
            raise SandboxRefused("params must be a map")
        unknown = [k for k in params if not isinstance(k, str) or (k not in self.params and not self.var_kw)]
        if unknown:
            raise SandboxRefused(f"{self.entry} takes no parameter(s) {unknown}; it takes {sorted(self.params)}")
        missing = sorted(self.required - set(params))
        if missing:
            raise SandboxRefused(f"{self.entry} needs parameter(s) {missing}")
        for k in params:
            if k.startswith(policy.PRIVATE_NAME):
                raise SandboxRefused(f"parameter name {k!r} is not allowed")

    def bind(self, params: dict, deadline: float | None = None, budget: float | None = None):
        """A fresh intervention for one request: ``(fn, clock)``; runs the module body (defs and imports only).

        ``deadline``: wall-clock limit (``time.monotonic()``); ``budget``: CPU seconds the code may run in
        all (see :class:`~.clock.Clock`). The clock is the request's :class:`~asyncinterp.serve.scheduling.batcher.Meter`:
        pass it to the batcher (``meter=clock``) so that its time is accounted to it and credited to the
        other requests' deadlines.
        """
        self.check_params(params)
        clock = Clock(deadline, budget)
        clock.grad = self.needs_grad
        g = {"__builtins__": safe_builtins(), "__name__": "submitted", TICK: clock.tick, SETPOINT: setpoint,
             PLAIN: text_safe, MEMBER: read_unlisted}
        exec(self.code, g)  # noqa: S102 - checked and restricted above; top level holds only defs/imports/literals
        entry = g[self.entry]

        params = {k: sanitize(v) if isinstance(v, (torch.Tensor, list, tuple, dict)) else v
                  for k, v in params.items()}

        async def submitted(m):
            return release(await Driven(entry(SafeEnvoy(m), **params), clock))

        submitted.__qualname__ = submitted.__name__ = self.entry
        submitted.needs_grad = self.needs_grad      # the batcher runs it with autograd on, with its kind only
        return submitted, clock


class ProgramCache:
    """Compiled programs by source (and entry), least recently used first out."""

    def __init__(self, size: int = policy.PROGRAM_CACHE_SIZE):
        self.size = size
        self._items = LRU(size, on_evict=lambda _, prog: linecache.cache.pop(prog.filename, None))

    def get(self, source: str, entry: str | None = None) -> Program:
        key = (source, entry)
        prog = self._items.get(key)
        if prog is None:
            prog = self._items.put(key, Program(source, entry))
        return prog
