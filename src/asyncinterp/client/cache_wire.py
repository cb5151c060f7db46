"""An activation cache (``ai.Cache``) as an intervention of a remote job: its options go, its records come back.

A :class:`~asyncinterp.tools.cache.Cache` is an intervention object, not a
function, so it does not travel as source. Its options do
(:func:`describe_cache`: the filter as paths and globs, the points,
``detach``/``clone``/``include_root``, ``steps``, ``start``); the server
builds its own ``Cache`` from them (:func:`build_cache`: trusted code of
ours, so it taps the model's points directly) and answers with what it
recorded (:func:`recorded_of`); the client fills the user's cache object
with it (:func:`fill_cache`), so ``ai.cache(remote_model, x, "layers.*")``
and ``remote_model.trace(x, cache)`` read as locally. What does not
travel: a filter function (send paths or globs), ``device=`` (records
arrive on the client's CPU), and a cache referenced from inside another
intervention (``cache.start()`` / ``cache.stop()``): each a clear ``TypeError``.
"""

from __future__ import annotations

from ..hooks.envoy import Envoy
from ..tools.cache import Cache
from .wire import DescriptionRefused

__all__ = ["build_cache", "describe_cache", "fill_cache", "recorded_of"]

_FLAGS = ("detach", "clone", "include_root")


def describe_cache(cache: Cache) -> dict:
    """The options of ``cache`` as plain data (``TypeError`` for what cannot travel)."""
    spec = cache.filter
    if isinstance(spec, (str, Envoy)) or spec is None:
        spec = [spec] if spec is not None else None
    if spec is not None:
        if callable(spec) and not isinstance(spec, Envoy) or not isinstance(spec, (list, tuple)):
            raise TypeError(f"{cache!r}: a cache filter function cannot travel to a server; filter by module paths "
                            "or globs (\"model.layers.*\")")
        paths = []
        for item in spec:
            if isinstance(item, Envoy):
                item = item.path
            if not isinstance(item, str):
                raise TypeError(f"{cache!r}: a cache filter of {type(item).__name__} cannot travel to a server; "
                                "filter by module paths or globs")
            paths.append(item)
        spec = paths
    steps = cache.steps
    if isinstance(steps, slice):
        steps = {"slice": [steps.start, steps.stop, steps.step]}
    elif steps is not None and not isinstance(steps, int):
        steps = sorted(int(s) for s in steps)
    return {"modules": spec, "points": list(cache.points), "steps": steps, "start": cache.start_on,
            **{f: bool(getattr(cache, f)) for f in _FLAGS}}


def build_cache(options) -> "CacheJob":
    """The server's intervention for a cache described by :func:`describe_cache` (checked as untrusted data)."""
    if not isinstance(options, dict):
        raise DescriptionRefused("a cache of the job is not a map")
    modules = options.get("modules")
    if modules is not None and (not isinstance(modules, list) or len(modules) > 10_000
                                or not all(isinstance(p, str) and len(p) < 1000 for p in modules)):
        raise DescriptionRefused("a cache's modules are a list of paths or globs")
    steps = options.get("steps")
    if isinstance(steps, dict):
        bounds = steps.get("slice")
        if not isinstance(bounds, list) or len(bounds) != 3 or not all(b is None or type(b) is int for b in bounds):
            raise DescriptionRefused("a cache's steps slice is [start, stop, step]")
        steps = slice(*bounds)
    elif steps is not None and type(steps) is not int and not (
            isinstance(steps, list) and all(type(s) is int for s in steps)):
        raise DescriptionRefused("a cache's steps are an int, a slice or a list of ints")
    points = options.get("points")
    if not isinstance(points, list) or not all(isinstance(p, str) for p in points):
        raise DescriptionRefused("a cache's points are a list of names")
    try:
        cache = Cache(modules, points=tuple(points), steps=steps, start=bool(options.get("start", True)),
                      **{f: bool(options.get(f, f == "detach")) for f in _FLAGS})
    except (TypeError, ValueError) as exc:
        raise DescriptionRefused(f"a cache of the job is invalid: {exc}") from None
    return CacheJob(cache)


class CacheJob:
    """A server-side cache as an intervention: runs the cache, returns it (turned into data when answered)."""

    def __init__(self, cache: Cache):
        self.cache = cache
        self.__qualname__ = self.__name__ = "cache"

    async def __call__(self, m):
        return await self.cache(m)


def recorded_of(value):
    """A result as it travels: a cache becomes ``{"cache": {key: [[step, value], ...]}}`` (its values copied)."""
    if isinstance(value, Cache):
        return {"cache": {k: [[step, _copy(v)] for step, v in entries] for k, entries in value.recorded.items()}}
    if type(value) is tuple:
        return tuple(recorded_of(v) for v in value)
    return value


def _copy(v):
    import torch
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, (list, tuple)):
        return type(v)(_copy(x) for x in v)
    return v


def fill_cache(fns, value):
    """The client side: put each returned cache record into the user's cache object; the invoke's result."""
    if len(fns) > 1 and isinstance(value, (list, tuple)) and len(value) == len(fns):
        return tuple(fill_cache((fn,), v) for fn, v in zip(fns, value))
    fn = fns[0] if fns else None
    if isinstance(fn, Cache) and isinstance(value, dict) and isinstance(value.get("cache"), dict):
        fn.recorded = {k: [(step, v) for step, v in entries] for k, entries in value["cache"].items()}
        return fn
    return value
