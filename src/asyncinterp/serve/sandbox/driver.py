"""Running a coroutine of submitted code as a task: edits written back, every resumption timed.

:class:`Driven` wraps each coroutine of submitted code (the entry point,
spawned and gathered ones). Between two of its awaits it writes in-place
edits of the private copies it was handed back into the model, checked,
through ``point.replace`` (:class:`TaskState`), and it times every
resumption on the request's clock, which is how the compute budget counts
only the code's own time.
"""

from __future__ import annotations

import threading

from ...kernel.scheduler import current_run
from ...kernel.traps import PointTrap
from .values import check_replacement, rebuild
from .tensors import DisableTorchFunction, version_of


class Pending:
    """An awaited value whose private copies may be edited in place before the task awaits again."""

    __slots__ = ("point", "raw", "leaves", "done")

    def __init__(self, point, raw, leaves):
        self.point, self.raw, self.leaves, self.done = point, raw, leaves, False


class TaskState:
    """Per task of submitted code: awaited values whose private copies may be edited in place, and the
    clock of its request (every resumption of the task is timed on it)."""

    __slots__ = ("pending", "clock")

    def __init__(self, clock=None):
        self.pending = []
        self.clock = clock

    def forget(self, point):
        """An explicit replacement of ``point``: its pending in-place edits are dropped; returns the value."""
        key = getattr(point, "key", point)
        raw = None
        for p in self.pending:
            if getattr(p.point, "key", p.point) == key:
                p.done = True
                raw = p.raw
        return raw

    def flush(self, keep: bool = False):
        """Write in-place edits of private copies back through ``point.replace`` (called when the task
        awaits something else or returns: while the point is still firing).

        ``keep``: the task waits for something that is not a hook point (a future, a sub-task), so the
        model may still be at the same point when it resumes (a future set by a later invoke at the same
        point): the copies stay watched, and later edits are written back while their point still fires
        (after that, as locally, editing a value the model has moved past changes nothing)."""
        pending = self.pending
        self.pending = pending if keep else []
        for p in pending:
            if p.done:
                continue
            changes = {}
            for path, raw_leaf, private, version in p.leaves:
                # a copy connected to the autograd graph (a gradient request) is always written back: the model
                # continues with it for this request's rows, so gradients with respect to it exist
                edited = version_of(private) != version
                if edited or _on_graph(private):
                    what = f"in-place edit of {p.point.describe() if hasattr(p.point, 'describe') else 'a value'}"
                    with DisableTorchFunction():
                        copied = private.clone()
                    # unedited (only routed through the copy): the model's own values, -inf masks included
                    changes[path] = check_replacement(copied, raw_leaf, what) if edited else copied
            if changes and _firing(p.point):
                p.point.replace(rebuild(p.raw, changes))
            if keep:
                p.leaves = [(path, raw, copied, version_of(copied)) for path, raw, copied, _ in p.leaves]
        if keep:
            self.pending = [p for p in pending if not p.done and _firing(p.point)]


def _firing(point) -> bool:
    """Whether ``point`` is firing now in the current run (points of other kinds: assumed so)."""
    key = getattr(point, "key", None)
    run = current_run()
    firing = getattr(run, "firing", None)
    if key is None or firing is None:
        return True
    return firing(key) is not None


def _on_graph(t) -> bool:
    with DisableTorchFunction():
        return t.requires_grad


_LOCAL = threading.local()


def current_state():
    """The :class:`TaskState` of the task of submitted code running on this thread, or ``None``."""
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


class Driven:
    """Runs a coroutine of submitted code as a task, flushing its in-place edits at every await and
    timing every resumption on its request's clock (the compute budget)."""

    __slots__ = ("coro", "clock")

    def __init__(self, coro, clock=None):
        self.coro = coro
        self.clock = clock

    def __await__(self):
        coro, clock = self.coro, self.clock
        state = TaskState(clock)
        __ai_inner__ = coro   # noqa: F841 - lets await_site find the user's line inside the driven coroutine
        stack = getattr(_LOCAL, "stack", None)
        if stack is None:
            stack = _LOCAL.stack = []
        send, exc = None, None
        try:
            while True:
                stack.append(state)
                if clock is not None:
                    clock.resume()
                try:
                    trap = coro.throw(exc) if exc is not None else coro.send(send)
                    state.flush(keep=not isinstance(trap, PointTrap))
                except StopIteration as stop:
                    state.flush()
                    return stop.value
                finally:
                    if clock is not None:
                        clock.pause()
                    stack.pop()
                try:
                    send, exc = (yield trap), None
                except GeneratorExit:
                    raise
                except BaseException as e:  # noqa: BLE001 - delivered to the submitted coroutine
                    send, exc = None, e
        finally:
            if clock is not None:
                clock.resume()   # its finally blocks run now: on its clock too
            try:
                coro.close()
            finally:
                if clock is not None:
                    clock.pause()
