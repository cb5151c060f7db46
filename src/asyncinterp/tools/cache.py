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
"""

from __future__ import annotations

import copy
import fnmatch
import re

import torch

from ..kernel.scheduler import current_kernel, current_task
from ..hooks.views import map_tensors

__all__ = ["Cache", "KeyNode", "cache"]

_POINT_NAMES = ("output", "input", "inputs")


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
                 detach: bool = True, device=None, clone: bool = False, include_root: bool = False):
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
        self.recorded = {}    # key -> [(step, value), ...]; keys in first-firing order

    # ------------------------------------------------------------ recording
    async def __call__(self, m):
        kernel = current_kernel()
        run = kernel.host
        group = current_task().group
        self.recorded = {}
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
            return KeyNode(self, key, "cache")
        entries = self._entries(key)
        if len(entries) == 1:
            return entries[0][1]
        return [v for _, v in entries]

    def _entries(self, key):
        try:
            return self.recorded[key]
        except KeyError:
            keys = list(self.recorded)
            close = [k for k in keys if key in k][:5] or keys[:5]
            raise KeyError(f"{key!r} is not in this cache; keys look like {close}"
                           + (" (the cache is empty: has it been run?)" if not keys else "")) from None

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        node = KeyNode(self, name, "cache")
        return node[None] if name in self.recorded else node

    def step(self, step: int) -> "Cache":
        """A cache holding only the values recorded in generation step ``step``."""
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
            raise AttributeError(f"the {self._what} has nothing under {key!r}; keys look like {list(table)[:5]}")
        return KeyNode(table, key, self._what)

    def __getitem__(self, index):
        if index is None:
            return self._table[self._prefix]
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
