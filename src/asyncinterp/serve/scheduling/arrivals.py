"""Requests on their way to the serving front: the only reason a batch ever waits for company.

A request that reaches an idle engine starts at once; requests that come
while a forward runs join the next one (continuous batching). The batching
window (``max_wait_ms``) applies only when there is something to batch with:
other requests already received by the server (their bodies being read,
parsed, tokenized, checked) but not yet handed to the front. This module
counts those.

The server opens an :class:`Arrival` when a request comes in (the HTTP
front's guard around each model request, ``Server.guarded``, or a worker
process when a message arrives), in a context
variable; the front closes it when the request is submitted
(:func:`submitted`), and the guard closes it in any case when the
request ends, so a refused request never leaves a phantom arrival behind.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading

__all__ = ["Arrivals", "Arrival", "submitted"]

_current: contextvars.ContextVar = contextvars.ContextVar("asyncinterp_arrival", default=None)


class Arrival:
    """``n`` requests between their arrival and their submission; each submission takes one off."""

    __slots__ = ("owner", "remaining")

    def __init__(self, owner: "Arrivals", n: int):
        self.owner = owner
        self.remaining = n

    def submitted(self) -> None:
        if self.remaining > 0:
            self.remaining -= 1
            self.owner.leave(1)

    def close(self) -> None:
        """The block ended: what was expected and never came is not waited for any longer."""
        if self.remaining > 0:
            n, self.remaining = self.remaining, 0
            self.owner.leave(n)


class Arrivals:
    """How many requests are on their way to one front; ``changed`` (a Condition) hears every change.

    ``count``: those this process received and has not submitted; ``relayed``: those another process (the
    server, for a worker process) says are on their way to it; ``on_change(total)``: called after each change
    of ``count`` (a supervisor relays it to its workers)."""

    def __init__(self, changed: threading.Condition, on_change=None):
        self.changed = changed
        self.count = 0
        self.relayed = 0
        self.on_change = on_change

    @property
    def total(self) -> int:
        return self.count + self.relayed

    def leave(self, n: int) -> None:
        with self.changed:
            self.count -= n
            self.changed.notify_all()
            count = self.count
        if self.on_change is not None:
            self.on_change(count)

    def relay(self, n: int) -> None:
        """Another process says ``n`` requests are on their way here."""
        with self.changed:
            self.relayed = max(0, int(n))
            self.changed.notify_all()

    @contextlib.contextmanager
    def expect(self, n: int = 1):
        """``n`` requests are on their way (submitted in this context, or its tasks'): until they are submitted,
        or this block ends, a batch that starts may wait for them (at most the front's ``max_wait_ms``).

        The server opens one per received request; in process, ``with batcher.arrivals.expect(len(prompts)):
        await asyncio.gather(*(batcher.trace(p, fn) for p in prompts))`` runs them as one batch.
        """
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"expect(n) takes a positive number of requests, got {n!r}")
        with self.changed:
            self.count += n
            count = self.count
        if self.on_change is not None:
            self.on_change(count)
        arrival = Arrival(self, n)
        token = _current.set(arrival)
        try:
            yield arrival
        finally:
            _current.reset(token)
            arrival.close()


def submitted() -> None:
    """A request reached the front: one fewer of the current context's arrivals is on its way."""
    arrival = _current.get()
    if arrival is not None:
        arrival.submitted()
