"""Exceptions users see, shared by every layer.

They live in the kernel package because the kernel raises the scheduling ones
(out of order, missed point, foreign await) and the kernel imports nothing
below it. Every message says what happened, where, and what to do instead.
"""

from __future__ import annotations

import os
import sys
import types

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_KERNEL_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


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
    awaited) down to the frame that awaited one of our awaitables. A sub-task
    made by ``ai.spawn(point)`` / ``ai.gather`` has no user frame of its own:
    it reports the line that made it.
    """
    frame = None
    site = None
    obj = coro
    seen = 0
    while obj is not None and seen < 100:
        seen += 1
        f = getattr(obj, "cr_frame", None) or getattr(obj, "gi_frame", None) or getattr(obj, "ag_frame", None)
        if f is None:
            break
        if not f.f_code.co_filename.startswith(_PKG_DIR):
            frame = f
        elif site is None and "__ai_site__" in f.f_code.co_varnames:
            site = f.f_locals.get("__ai_site__")
        nxt = getattr(obj, "cr_await", None)
        if nxt is None:
            nxt = getattr(obj, "gi_yieldfrom", None)
        if nxt is None:
            nxt = getattr(obj, "ag_await", None)
        if nxt is None and "__ai_inner__" in f.f_code.co_varnames:
            nxt = f.f_locals.get("__ai_inner__")   # a driver that steps an inner coroutine by hand
        obj = nxt
    if frame is None:
        return site or "<unknown line>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} (in {frame.f_code.co_name})"


def user_site(depth: int = 1) -> str | None:
    """``file:line (in function)`` of the innermost caller outside asyncinterp, or ``None``."""
    f = sys._getframe(depth)
    while f is not None and f.f_code.co_filename.startswith(_PKG_DIR):
        f = f.f_back
    if f is None:
        return None
    return f"{f.f_code.co_filename}:{f.f_lineno} (in {f.f_code.co_name})"


def without_kernel_frames(exc: BaseException) -> BaseException:
    """Drop the scheduler's own frames from ``exc``'s traceback (the user's frames stay, in order)."""
    tb = exc.__traceback__
    frames = []
    while tb is not None:
        if not tb.tb_frame.f_code.co_filename.startswith(_KERNEL_DIR):
            frames.append(tb)
        tb = tb.tb_next
    if not frames or len(frames) == _length(exc.__traceback__):
        return exc
    new = None
    for tb in reversed(frames):
        new = types.TracebackType(new, tb.tb_frame, tb.tb_lasti, tb.tb_lineno)
    return exc.with_traceback(new)


def _length(tb) -> int:
    n = 0
    while tb is not None:
        n += 1
        tb = tb.tb_next
    return n
