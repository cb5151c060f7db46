"""Activation cache: collect many hook points in one run without a coroutine per point.

A :class:`Cache` is an intervention. When its run starts it taps the hook
points its filters select (``run.tap``: the run's own lazy hooks, so only the
selected modules are hooked) and records, for its invoke's rows, the value
the model continues with at each firing, in every step of a generation::

    cache = ai.Cache("model.layers.*", inputs=True)
    model.trace(x, cache)                  # or: ai.cache(model, x, "model.layers.*")
    cache.model.layers[3].output           # attribute access
    cache["model.layers.3.input"]          # or by key
    cache.step(2)                          # the values of generation step 2 only

Filters: ``None`` (every module but the root), a glob (``*`` matches within one
path segment, ``**`` across segments: ``"model.layers.*.mlp"``), a list of
paths, globs or envoys, or a predicate ``f(path, module) -> bool``.

A point that fired once gives its value; a point that fired several times in
the run (generation steps, a module called twice) gives a list in call order
(``cache.all(key)`` always gives the list, ``cache.step(k)`` one step).

Recording partway through a run: ``Cache(..., steps=slice(3, None))`` records
only those generation steps (an int, a slice, a range or any container of
step numbers); ``Cache(..., start=False)`` starts paused, and
``cache.start()`` / ``cache.stop()``, called from an intervention while the
run goes on, switch recording on and off (a firing is recorded if the cache
is on when the model continues past it).

Lookups fail like the containers they imitate: a missing key raises
``KeyError`` (``cache["x"]``, ``cache.all("x")``), a missing index
``IndexError`` (``cache.model.layers[99]``, ``cache.step(99)``), a missing
attribute an error that is both ``KeyError`` and ``AttributeError``; each
message names the closest keys.
"""

from __future__ import annotations

import copy
import difflib
import fnmatch
import re

import torch

from ..kernel.scheduler import current_kernel, current_task
from ..hooks.views import map_tensors

__all__ = ["Cache", "CacheIndexError", "CacheKeyError", "KeyNode", "cache"]

_POINT_NAMES = ("output", "input", "inputs")


class CacheKeyError(KeyError, AttributeError):
    """A key (or attribute) that a cache or scan result does not have.

    A ``KeyError`` like a dict's, and an ``AttributeError`` so that
    ``hasattr``/``getattr(obj, name, default)`` work on attribute access.
    """

    def __str__(self):
        return str(self.args[0]) if self.args else ""


class CacheIndexError(IndexError, AttributeError):
    """An index (``cache.model.layers[99]``, ``cache.step(99)``) that a cache does not have."""


def _close_keys(key, keys, n=5):
    key = str(key)
    close = difflib.get_close_matches(key, keys, n=n, cutoff=0.6)
    for k in keys:
        if len(close) >= n:
            break
        if (key in k or k.startswith(key)) and k not in close:
            close.append(k)
    return close or keys[:n]


class Cache:
    """An intervention that records the selected hook points of its invoke.

    ``modules``: filter (see module docs). ``outputs``/``inputs``: record
    ``.output`` and/or ``.input`` (the first argument); ``points`` overrides
    both with explicit point names (``("output", "inputs")``). ``detach``
    (default) detaches tensors from the autograd graph, ``device`` moves them
    (``"cpu"`` to offload), ``clone`` copies them so later in-place edits of
    the model's tensors do not show in the cache.
    """

    def __init__(self, modules=None, *, outputs: bool = True, inputs: bool = False, points=None,
                 detach: bool = True, device=None, clone: bool = False, include_root: bool = False,
                 steps=None, start: bool = True):
        if points is None:
            points = (("output",) if outputs else ()) + (("input",) if inputs else ())
        points = (points,) if isinstance(points, str) else tuple(points)
        bad = [p for p in points if p not in _POINT_NAMES]
        if bad:
            raise ValueError(f"cache points must be among {_POINT_NAMES}, got {bad}")
        if not points:
            raise ValueError("this cache records nothing: pass outputs=True, inputs=True or points=(...)")
        self.filter = modules
        self.points = points
        self.detach = detach
        self.device = device
        self.clone = clone
        self.include_root = include_root
        if steps is not None and not isinstance(steps, (int, slice)) and not hasattr(steps, "__contains__"):
            raise TypeError(f"steps= takes an int, a slice, a range or a container of step numbers, got {steps!r}")
        if isinstance(steps, slice) and (steps.step or 1) < 1:
            raise ValueError(f"steps={steps!r}: a slice of steps needs a positive stride")
        self.steps = steps
        self.start_on = bool(start)
        self.recording = self.start_on   # switched by start()/stop() while a run goes on
        self._switched_in = None         # the kernel of the run where start()/stop() was last called
        self.recorded = {}    # key -> [(step, value), ...]; keys in first-firing order

    # ------------------------------------------------------------ switching
    def start(self) -> None:
        """Record from now on (call from an intervention while the run goes on)."""
        self.recording = True
        self._switched_in = current_kernel()

    def stop(self) -> None:
        """Stop recording from now on; what was recorded stays."""
        self.recording = False
        self._switched_in = current_kernel()

    def _wants_step(self, step) -> bool:
        steps = self.steps
        if steps is None:
            return True
        if isinstance(steps, int):
            return step == steps
        if isinstance(steps, slice):
            start = steps.start or 0
            if step < start or (steps.stop is not None and step >= steps.stop):
                return False
            return (step - start) % (steps.step or 1) == 0
        return step in steps

    # ------------------------------------------------------------ recording
    async def __call__(self, m):
        kernel = current_kernel()
        run = kernel.host
        group = current_task().group
        self.recorded = {}
        if self._switched_in is not kernel:    # start()/stop() of an earlier run do not carry over
            self.recording = self.start_on
        selected = select(m, self.filter, self.include_root)
        if not selected:
            raise ValueError(f"the cache filter {self.filter!r} selects no module of this model")
        for envoy in selected:
            for name in self.points:
                point = getattr(envoy, name)
                run.tap(point.key, self._recorder(run, group, point))
        return self

    def _recorder(self, run, group, point):
        path = point.envoy.path
        key = f"{path}.{point.name}" if path else point.name
        read = point.read if point.key is not point else None
        detach, device, clone = self.detach, self.device, self.clone

        def prepare(t):
            if detach:
                t = t.detach()
            if device is not None:
                t = t.to(device)
            if clone:
                t = t.clone()
            return t

        def record(value):
            if not self.recording or not self._wants_step(run.kernel.step):
                return
            v = run.layout.view(value, group)
            if read is not None:
                v = read(v)
            v = map_tensors(prepare, v)
            entries = self.recorded.get(key)
            if entries is None:
                self.recorded[key] = entries = []
            entries.append((run.kernel.step, v))
        return record

    # -------------------------------------------------------------- reading
    def keys(self):
        return list(self.recorded)

    def __iter__(self):
        return iter(self.keys())

    def __len__(self):
        return len(self.recorded)

    def __contains__(self, key):
        return key in self.recorded

    def items(self):
        return [(k, self[k]) for k in self.recorded]

    def all(self, key) -> list:
        """Every recorded value of ``key``, in call order."""
        return [v for _, v in self._entries(key)]

    def steps_of(self, key) -> list:
        """The generation step of each recorded value of ``key``."""
        return [s for s, _ in self._entries(key)]

    def __getitem__(self, key):
        if isinstance(key, str) and key not in self.recorded and not key.endswith(_POINT_NAMES):
            if any(k.startswith(key + ".") for k in self.recorded):
                return KeyNode(self, key, "cache")
        entries = self._entries(key)
        if len(entries) == 1:
            return entries[0][1]
        return [v for _, v in entries]

    def _entries(self, key):
        try:
            return self.recorded[key]
        except (KeyError, TypeError):
            keys = list(self.recorded)
            if not keys:
                raise CacheKeyError(f"{key!r} is not in this cache: the cache is empty (has it been run? did its "
                                    "filter, steps= or start()/stop() leave nothing to record?)") from None
            raise CacheKeyError(f"{key!r} is not in this cache; did you mean one of {_close_keys(key, keys)}?"
                                ) from None

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self.recorded:
            return self[name]
        return KeyNode(self, "", "cache")._sub(name)

    def step(self, step: int) -> "Cache":
        """A cache holding only the values recorded in generation step ``step``."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"cache.step() takes a step number, got {step!r}")
        steps = sorted({s for entries in self.recorded.values() for s, _ in entries})
        if step < 0:
            if -step > len(steps):
                raise CacheIndexError(f"cache.step({step}): the cache holds {len(steps)} step(s): {steps}")
            step = steps[step]
        elif step not in steps:
            raise CacheIndexError(f"cache.step({step}): nothing was recorded in step {step}; recorded steps: "
                                  f"{steps}" + ("" if steps else " (the cache is empty: has it been run?)"))
        out = copy.copy(self)
        out.recorded = {}
        for k, entries in self.recorded.items():
            picked = [(s, v) for s, v in entries if s == step]
            if picked:
                out.recorded[k] = picked
        return out

    def to_dict(self) -> dict:
        return {k: self[k] for k in self.recorded}

    def __repr__(self):
        keys = list(self.recorded)
        if not keys:
            return "<ai.Cache (empty)>"
        lines = [f"<ai.Cache: {len(keys)} points>"]
        for k in keys[:40]:
            vals = self.all(k)
            lines.append(f"  {k}: {_describe(vals[0])}" + (f" x{len(vals)}" if len(vals) > 1 else ""))
        if len(keys) > 40:
            lines.append(f"  ... {len(keys) - 40} more")
        return "\n".join(lines)


class KeyNode:
    """Attribute/index access into a table of dotted keys: ``cache.model.layers[3].output``.

    ``table`` is anything with ``key in table``, ``table[key]`` and iteration
    over its keys (a :class:`Cache`, scan's ``Shapes``); ``what`` names it in
    error messages. A node stands for a key prefix; stepping to a full key
    gives that key's value, and ``node[None]`` the value of the prefix itself.
    """

    __slots__ = ("_table", "_prefix", "_what")

    def __init__(self, table, prefix: str, what: str):
        self._table = table
        self._prefix = prefix
        self._what = what

    def _sub(self, name):
        table = self._table
        key = f"{self._prefix}.{name}" if self._prefix else str(name)
        if key in table:
            return table[key]
        if not any(k.startswith(key + ".") for k in table):
            keys = list(table)
            under = sorted({k[len(self._prefix) + 1:].split(".", 1)[0] for k in keys
                            if k.startswith(self._prefix + ".")} if self._prefix else
                           {k.split(".", 1)[0] for k in keys})
            msg = f"the {self._what} has nothing under {key!r}"
            if under:
                msg += f"; under {self._prefix or 'its root'!r} it has {under[:10]}"
            msg += f"; did you mean one of {_close_keys(key, keys)}?" if keys else f"; the {self._what} is empty"
            if isinstance(name, int):
                raise CacheIndexError(msg)
            raise CacheKeyError(msg)
        return KeyNode(table, key, self._what)

    def __getitem__(self, index):
        if index is None:
            return self._table[self._prefix]
        if isinstance(index, bool) or not isinstance(index, (int, str)):
            raise TypeError(f"{self._what} entries are indexed by module index or name, got {index!r}")
        return self._sub(index)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._sub(name)

    def __repr__(self):
        keys = [k for k in self._table if k.startswith(self._prefix + ".")]
        return f"<{self._what} entries under {self._prefix!r}: {len(keys)} keys>"


def _describe(v):
    if isinstance(v, torch.Tensor):
        return f"Tensor{tuple(v.shape)} {str(v.dtype).replace('torch.', '')}"
    if isinstance(v, (tuple, list)):
        return type(v).__name__ + "(" + ", ".join(_describe(x) for x in v[:4]) + (", ..." if len(v) > 4 else "") + ")"
    return type(v).__name__


# ---------------------------------------------------------------- filters
def _glob_regex(pattern: str):
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^.]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^.]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def select(model, spec, include_root: bool = False) -> list:
    """The envoys of ``model`` a filter selects (see module docs), in module order."""
    from ..hooks.envoy import Envoy
    every = model.modules()
    if spec is None:
        return [e for e in every if e.path or include_root]
    if callable(spec) and not isinstance(spec, (str, Envoy)):
        return [e for e in every if (e.path or include_root) and spec(e.path, e.module)]
    specs = [spec] if isinstance(spec, (str, Envoy)) else list(spec)
    paths = set()
    patterns = []
    for s in specs:
        if isinstance(s, Envoy):
            paths.add(s.path)
        elif isinstance(s, str):
            if any(c in s for c in "*?["):
                patterns.append(_glob_regex(s))
            else:
                paths.add(s)
        else:
            raise TypeError(f"a cache filter entry must be a path, a glob or an envoy, got {s!r}")
    known = {e.path for e in every}
    missing = sorted(p for p in paths if p not in known)
    if missing:
        close = fnmatch.filter(sorted(known), "*" + missing[0].rsplit(".", 1)[-1] + "*")[:5]
        raise ValueError(f"cache filter names modules that do not exist: {missing}" +
                         (f"; similar paths: {close}" if close else ""))
    return [e for e in every if e.path in paths or any(p.match(e.path) for p in patterns)]


def cache(model, input, modules=None, **options) -> Cache:
    """Run one forward of ``model`` on ``input`` and return a :class:`Cache` of the selected points."""
    c = Cache(modules, **options)
    model.trace(input, c)
    return c
