"""Futures: plain values one task hands to another (or to a later run).

``ai.Future`` is how invokes share values without barriers: invoke A calls
``fut.set_result(x)`` at a hook point, invoke B does ``await fut``. If B gets
there first it is parked and resumed as soon as A sets the value, inside the
same hook firing. A future is not tied to a run, so a value set in one trace
can be awaited in a later one (sessions).

The kernel uses only the public API below: ``done``/``result``/``exception``
to read the outcome, ``add_done_callback``/``remove_done_callback`` to be told
when a future it parked a task on is set (and to forget that when the wait is
given up).
"""

from __future__ import annotations

from .traps import FutureTrap

_PENDING = object()


class Future:
    """A one-shot value that tasks can await."""

    __slots__ = ("_value", "_exc", "_callbacks", "name")

    def __init__(self, name: str | None = None):
        self._value = _PENDING
        self._exc = None
        self._callbacks = []
        self.name = name

    def done(self) -> bool:
        """True once a value or an exception was set."""
        return self._value is not _PENDING or self._exc is not None

    def result(self):
        """The value; raises if it failed or is not set yet."""
        if self._exc is not None:
            raise self._exc
        if self._value is _PENDING:
            raise RuntimeError(f"{self!r} has no result yet")
        return self._value

    def exception(self) -> BaseException | None:
        """The exception it was set with, or ``None`` for a value; raises if not set yet."""
        if self._exc is None and self._value is _PENDING:
            raise RuntimeError(f"{self!r} has no result yet")
        return self._exc

    def set_result(self, value) -> None:
        self._settle(value, None)

    def set_exception(self, exc: BaseException) -> None:
        self._settle(_PENDING, exc)

    def add_done_callback(self, fn) -> None:
        """Call ``fn(future)`` once, when the future is set (at once if it already is).

        Callbacks run on the thread that sets the future, in the order they
        were added.
        """
        if self.done():
            fn(self)
        else:
            self._callbacks.append(fn)

    def remove_done_callback(self, fn) -> int:
        """Forget every registration of ``fn`` (compared by identity); returns how many there were."""
        before = len(self._callbacks)
        self._callbacks = [f for f in self._callbacks if f is not fn]
        return before - len(self._callbacks)

    def _settle(self, value, exc):
        if self.done():
            raise RuntimeError(f"{self!r} is already set; a Future takes one value")
        self._value, self._exc = value, exc
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

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
