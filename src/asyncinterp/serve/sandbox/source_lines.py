"""Source lines of submitted and captured code for tracebacks: under server-made names, bounded, evicted.

Tracebacks read source lines from :mod:`linecache` by file name. Code a
server compiles from a request is put there so that errors show the user's
own lines, which raises three problems this module answers:

* **names**: the file name must be made by the server, per job
  (:func:`job_filename`), never chosen by the client, or one tenant's job
  could register lines under another tenant's name and read them back in its
  own traceback;
* **size**: captured source is placed at its original line (padding lines
  before it), so a client-chosen line number would cost memory per line;
  the lines are kept sparse here (only the non-blank ones);
* **lifetime**: entries are evicted, least recently added first, beyond
  :data:`MAX_ENTRIES` names or :data:`MAX_CHARS` characters in all.
"""

from __future__ import annotations

import collections
import linecache
import secrets
import threading

from ...lru import LRU

__all__ = ["MAX_CHARS", "MAX_ENTRIES", "job_filename", "job_token", "remember"]

MAX_ENTRIES = 2048
MAX_CHARS = 8 * 2**20

_kept = collections.OrderedDict()   # file name -> characters kept
_LINES = LRU(256, max_weight=MAX_CHARS, weigh=lambda text, _: len(text))   # text -> its lines (read only)
_total = 0
_lock = threading.Lock()


def job_token() -> str:
    """A fresh, unguessable token naming one job's compiled sources."""
    return secrets.token_hex(8)


def job_filename(kind: str, name: str, where: str, token: str) -> str:
    """``<KIND NAME from WHERE #TOKEN>``: readable in a traceback, unique per job (``token``)."""
    return f"<{kind} {name} from {where[:200]} #{token}>"


class _SparseLines(list):
    """A source's lines as :mod:`linecache` reads them (``len`` and indexing), its blank lines not stored."""

    def __init__(self, text: str):
        super().__init__()
        lines = text.splitlines(True)
        self.count = len(lines)
        self.kept = {i: line for i, line in enumerate(lines) if line.strip()}
        self.chars = sum(len(line) for line in self.kept.values())

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.count))]
        if i < 0:
            i += self.count
        if not 0 <= i < self.count:
            raise IndexError("line index out of range")
        return self.kept.get(i, "\n")

    def __iter__(self):
        return (self[i] for i in range(self.count))

    def __bool__(self):
        return self.count > 0


def remember(filename: str, text: str) -> None:
    """Make ``text`` the source of ``filename`` for tracebacks, within the bounds (see the module docs)."""
    global _total
    lines = _LINES.get(text)
    if lines is None:     # (the same text sent again, under another job's name: its lines are made once)
        lines = _LINES.put(text, _SparseLines(text))
    with _lock:
        old = _kept.pop(filename, None)
        if old is not None:
            _total -= old
        _kept[filename] = lines.chars
        _total += lines.chars
        linecache.cache[filename] = (lines.chars, None, lines, filename)
        while _kept and (len(_kept) > MAX_ENTRIES or _total > MAX_CHARS):
            name, chars = _kept.popitem(last=False)
            _total -= chars
            linecache.cache.pop(name, None)
