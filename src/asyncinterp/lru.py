"""A small thread-safe map that forgets its least recently used entries: the one bounded cache we keep.

The client keeps parsed sources per code object, the sandbox its checked and
compiled sources and programs: each is a map bounded by a count (and, for
submitted sources, by their total size), used from several threads, whose
values are computed outside its lock (two threads may compute the same value
at once; the first stored wins and both get it). ``on_evict(key, value)``
runs for each entry that is forgotten (the sandbox drops its program's lines
from ``linecache`` there).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

__all__ = ["LRU"]


class LRU:
    """At most ``size`` entries, and at most ``max_weight`` in total ``weigh(key, value)`` if given."""

    __slots__ = ("size", "max_weight", "weigh", "on_evict", "weight", "_items", "_lock")

    def __init__(self, size: int, *, max_weight: float | None = None, weigh=None, on_evict=None):
        if size < 1:
            raise ValueError(f"an LRU keeps at least one entry, got size={size!r}")
        self.size = size
        self.max_weight = max_weight
        self.weigh = weigh
        self.on_evict = on_evict
        self.weight = 0
        self._items = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key, default=None):
        """The value under ``key`` (now the most recently used), or ``default``."""
        with self._lock:
            value = self._items.get(key, _MISSING)
            if value is _MISSING:
                return default
            self._items.move_to_end(key)
            return value

    def put(self, key, value):
        """Keep ``value`` under ``key`` unless a value is there already; returns the value kept."""
        evicted = []
        with self._lock:
            kept = self._items.get(key, _MISSING)
            if kept is not _MISSING:
                return kept
            self._items[key] = value
            if self.weigh is not None:
                self.weight += self.weigh(key, value)
            while len(self._items) > self.size or (
                    self.max_weight is not None and self.weight > self.max_weight and len(self._items) > 1):
                old_key, old = self._items.popitem(last=False)
                if self.weigh is not None:
                    self.weight -= self.weigh(old_key, old)
                evicted.append((old_key, old))
        if self.on_evict is not None:
            for old_key, old in evicted:
                self.on_evict(old_key, old)
        return value


_MISSING = object()
