"""Exceptions users see, shared by every layer.

They live in the kernel package because the kernel raises the scheduling ones
(out of order, missed point, foreign await) and the kernel imports nothing
below it. Every message says what happened, where, and what to do instead.
"""

from __future__ import annotations

import os

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class AsyncInterpError(Exception):
    """Base class of all asyncinterp errors."""


class OutOfOrderError(AsyncInterpError):
    """A task awaited a hook point that has already run in this forward pass."""


class MissedHookPoint(AsyncInterpError):
    """A task was still waiting for a hook point when its pass or run ended."""


class ForeignAwaitError(AsyncInterpError, TypeError):
    """An intervention awaited something asyncinterp's scheduler cannot drive."""


class NotInRunError(AsyncInterpError, RuntimeError):
    """A hook point was awaited (or replaced) outside a run that can deliver it."""


class ReplacementError(AsyncInterpError, ValueError):
    """A replacement value does not fit the hook point it replaces."""


class ModulePathError(AsyncInterpError, AttributeError):
    """A module path does not exist in the wrapped model."""


class UnsetFutureError(AsyncInterpError):
    """A task waited on a future that nobody set before the run ended."""


class RunCancelled(AsyncInterpError):
    """Raised out of the model's forward when a run is cancelled from outside."""


def await_site(coro) -> str:
    """``file:line (function)`` of the innermost user frame where ``coro`` is suspended.

    Follows ``cr_await`` through nested coroutines (helpers the intervention
    awaited) down to the frame that awaited one of our awaitables.
    """
    frame = None
    obj = coro
    seen = 0
    while obj is not None and seen < 100:
        seen += 1
        f = getattr(obj, "cr_frame", None) or getattr(obj, "gi_frame", None) or getattr(obj, "ag_frame", None)
        if f is None:
            break
        if not f.f_code.co_filename.startswith(_PKG_DIR):
            frame = f
        nxt = getattr(obj, "cr_await", None)
        if nxt is None:
            nxt = getattr(obj, "gi_yieldfrom", None)
        if nxt is None:
            nxt = getattr(obj, "ag_await", None)
        obj = nxt
    if frame is None:
        return "<unknown line>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} (in {frame.f_code.co_name})"
