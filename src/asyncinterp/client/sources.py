"""The source of a function the client sends, read and parsed once per code object, not on every request.

A sweep sends the same intervention thousands of times; reading it from its
file (``inspect.getsource``) and parsing it each time cost more than the
rest of the client's work together. Both are kept here, bounded, keyed by
the code object (a function redefined in a notebook cell is a new code
object, so it is read again). The parsed tree is shared: callers only read it.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

from ..lru import LRU

__all__ = ["parsed_source", "source_text"]

_cache = LRU(256)    # code object -> (dedented source, its parsed module or the SyntaxError) or the error of reading


def _read(fn):
    code = fn.__code__
    hit = _cache.get(code)
    if hit is None:
        try:
            source = textwrap.dedent(inspect.getsource(fn))
            try:
                hit = (source, ast.parse(source))
            except SyntaxError as exc:
                hit = (source, exc)
        except (OSError, TypeError) as exc:
            hit = exc
        hit = _cache.put(code, hit)
    if isinstance(hit, BaseException):
        raise hit
    return hit


def source_text(fn) -> str:
    """The dedented source of ``fn``; raises ``OSError``/``TypeError`` as ``inspect.getsource`` does."""
    return _read(fn)[0]


def parsed_source(fn):
    """``(source, tree)`` of ``fn`` (dedented, parsed); raises ``OSError``/``TypeError``/``SyntaxError`` as
    ``inspect.getsource`` and ``ast.parse`` do (the same error again for the same code object)."""
    source, tree = _read(fn)
    if isinstance(tree, SyntaxError):
        raise tree
    return source, tree
