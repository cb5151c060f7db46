"""Futures: plain values one task hands to another (or to a later run).

``ai.Future`` is how invokes share values without barriers: invoke A calls
``fut.set_result(x)`` at a hook point, invoke B does ``await fut``. If B gets
there first it is parked and resumed as soon as A sets the value, inside the
same hook firing. A future is not tied to a run, so a value set in one trace
can be awaited in a later one (sessions).
"""

from __future__ import annotations

from .traps import FutureTrap

_PENDING = object()


class Future:
    """A one-shot value that tasks can await."""

    __slots__ = ("_value", "_exc", "_waiters", "name")

    def __init__(self, name: str | None = None):
        self._value = _PENDING
        self._exc = None
        self._waiters = []  # (kernel, task)
        self.name = name

    def done(self) -> bool:
        return self._value is not _PENDING or self._exc is not None

    def result(self):
        """The value; raises if it failed or is not set yet."""
        if self._exc is not None:
            raise self._exc
        if self._value is _PENDING:
            raise RuntimeError(f"{self!r} has no result yet")
        return self._value

    def set_result(self, value) -> None:
        self._settle(value, None)

    def set_exception(self, exc: BaseException) -> None:
        self._settle(_PENDING, exc)

    def _settle(self, value, exc):
        if self.done():
            raise RuntimeError(f"{self!r} is already set; a Future takes one value")
        self._value, self._exc = value, exc
        waiters, self._waiters = self._waiters, []
        for kernel, task in waiters:
            kernel._future_done(task, self)

    def _add_waiter(self, kernel, task):
        self._waiters.append((kernel, task))

    def _remove_waiter(self, task):
        self._waiters = [(k, t) for k, t in self._waiters if t is not task]

    def __await__(self):
        if self._exc is not None:
            raise self._exc
        if self._value is not _PENDING:
            return self._value
        return (yield FutureTrap(self))

    def __repr__(self):
        state = "done" if self.done() else "pending"
        label = f" {self.name!r}" if self.name else ""
        return f"<ai.Future{label} {state}>"
