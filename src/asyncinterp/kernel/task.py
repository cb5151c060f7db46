"""The task record: one intervention coroutine (or a sub-task of one) and its bookkeeping.

Only the kernel writes a task's fields; other layers read them and ask for
changes through the methods below (or the kernel's). Not to be confused with
``tasks.py``, the user-facing combinators (spawn, gather, steps) built on traps.
Also here: how an intervention function is named and recognised
(``callable_name``, ``is_async_fn``), shared by every layer.
"""

from __future__ import annotations

import inspect


class Task:
    """One intervention coroutine (or a sub-task of one) and its bookkeeping."""

    __slots__ = (
        "coro", "group", "order", "named", "kernel", "consumed", "step", "position",
        "waiting", "abort", "done", "closed", "result", "exc", "joiners", "parent", "observed",
        "open_loops", "watch", "last_value", "__weakref__",
    )

    def __init__(self, coro, group, order, name, parent=None, kernel=None, step=0):
        self.coro = coro
        self.group = group          # the invoke this task belongs to
        self.order = order          # resume order at a shared firing
        self.named = name           # a name, or what to name it after (see ``name``)
        self.kernel = kernel        # the kernel running it (dropped when the kernel closes)
        if parent is None:
            self.consumed = {}
            self.step = step
            self.position = None
            self.observed = True
        else:
            self.consumed = dict(parent.consumed)
            self.step = parent.step
            self.position = parent.position
            self.observed = False
        self.waiting = None         # the trap this task is parked on
        self.abort = None           # how to give that wait up: abort(kernel, task), or None
        self.done = False
        self.closed = False
        self.result = None
        self.exc = None
        self.joiners = None         # tasks parked on this one (a list, made by the first join)
        self.parent = parent
        self.open_loops = 0         # step loops (m.steps()) entered and not yet ended
        self.watch = None           # host object told before/after the next resumption (watch.before(), .after(task))
        self.last_value = None      # the value of the last point this task was resumed at (task.position)

    @property
    def name(self) -> str:
        """A readable name: the one given, else the intervention function's, else the coroutine's."""
        named = self.named
        if type(named) is str:
            return named
        return callable_name(self.coro if named is None else named)

    @name.setter
    def name(self, value) -> None:
        self.named = value

    def watch_next(self, watch) -> None:
        """Call ``watch.before()`` and ``watch.after(task)`` around this task's next resumption (that one only)."""
        self.watch = watch

    def bind_next(self, key, call: int) -> None:
        """Bind this task's next await of point ``key`` to its call number ``call`` (from 0) in the current step.

        For a point whose calls are not counted by the task's own awaits (a
        gradient, computed once per backward pass however many sub-tasks wait).
        """
        self.consumed[key] = call

    def __repr__(self):
        return f"<Task {self.name} invoke={self.group} {'done' if self.done else 'live'}>"


def callable_name(obj) -> str:
    """A readable name for a function, coroutine or other object: qualname, else name, else repr."""
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)


def is_async_fn(fn) -> bool:
    """True for an ``async def`` function (or an object whose ``__call__`` is one)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
