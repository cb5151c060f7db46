"""A group of invokes that the batcher queues, runs and answers as one request (a remote job).

A remote trace with N invokes (``POST /v1/jobs``, :mod:`.jobs_api`) must run
as it runs locally: its invokes in the same forward, in their order, sharing
``ai.Future`` s. A :class:`Group` is one entry of the batcher's queue that
holds N :class:`Member` s (one :class:`~.requests.Request` per invoke). The
batcher never splits it: it counts for N invokes against ``max_batch`` and
goes into a batch whole or waits for the next one (:meth:`Batcher.group`).
Inside the batch each member is an ordinary request (its own invoke, its
own rows, its tokens tracked by the generation watch), so everything the
batcher does for single requests holds for groups too.

A member's outcome is collected by its group, not delivered to a caller;
when every member has one, the group delivers the list of ``(ok, value)``
pairs (a value, a :class:`~.requests.GenerateResult`, or an exception), in
invoke order. With ``on_error="stop"`` the first failure closes the group's
other invokes at their next hook point (a local run stops there too). The
group's meter (the request's sandbox clock) is shared by all members, so
the compute budget and the time limit count the whole group. A streaming
group forwards its members' events tagged with ``"invoke": i``.
"""

from __future__ import annotations

import threading

from ...kernel.errors import RunCancelled
from .requests import Request

__all__ = ["Group", "Member"]


class Member(Request):
    """One invoke of a :class:`Group`: a request whose outcome goes to its group."""

    __slots__ = ("group", "position")

    def deliver(self, ok: bool, value) -> None:
        with self.lock:
            if self.finished:
                return
            self.finished = True
            cancelled = self.state == "cancelled"
            self.state = "done"
        if cancelled and ok:
            ok, value = False, RunCancelled(f"invoke {self.position} of the job was closed")
        self.group.collect(self.position, ok, value)

    def event(self, item) -> None:
        self.group.event({**item, "invoke": self.position})


class Group(Request):
    """N invokes queued, batched and answered together (see the module docs)."""

    __slots__ = ("members", "outcomes", "on_error", "stopping", "_count")

    def __init__(self, kind, invokes, key, gen=None, max_new_tokens=None, on_cancel=None, stream=False,
                 meter=None, on_error="stop"):
        super().__init__(kind, None, (), {}, key, gen, max_new_tokens, on_cancel, stream, meter)
        self.on_error = on_error
        self.stopping = False
        self.outcomes = [None] * len(invokes)
        self._count = threading.Lock()
        self.members = []
        for i, (input, fns, *kwargs) in enumerate(invokes):
            member = Member(kind, input, fns, kwargs[0] if kwargs else {}, key, gen, max_new_tokens, None, stream,
                            self.meter)
            member.group = self
            member.position = i
            self.members.append(member)

    @property
    def size(self) -> int:
        """How many invokes this entry puts into a batch."""
        return len(self.members)

    # worker side -------------------------------------------------------------
    def start(self) -> bool:
        if not super().start():
            return False
        for member in self.members:
            member.start()
        return True

    def reset(self) -> None:
        """Before the batcher reruns this group alone (its shared batch failed): forget the failed run."""
        with self._count:
            self.outcomes = [None] * len(self.members)
        for member in self.members:
            with member.lock:
                member.finished = False
                member.state = "running"
            member.invoke = None
            member.tokens = None
            member.emitted = []
            member.streamed = 0

    def collect(self, position: int, ok: bool, value) -> None:
        """A member's outcome (worker thread); the group answers once every member has one."""
        with self._count:
            if self.outcomes[position] is not None:
                return
            self.outcomes[position] = (ok, value)
            complete = all(o is not None for o in self.outcomes)
            stop = not ok and self.on_error == "stop" and not self.stopping
            if stop:
                self.stopping = True
        if stop and not complete:
            for member in self.members:
                if member is not self.members[position] and not member.finished:
                    inv = member.invoke
                    if inv is not None:
                        inv.cancel()
        if complete:
            self.deliver(True, list(self.outcomes))

    def attach(self, invoke) -> None:   # a group has no invoke of its own (its members do)
        pass

    # loop side ---------------------------------------------------------------
    def cancel(self) -> None:
        with self.lock:
            if self.state in ("done", "cancelled"):
                return
            self.state = "cancelled"
        if self.on_cancel is not None:
            try:
                self.on_cancel()
            except Exception:  # noqa: BLE001 - a callback must not break cancellation
                pass
        for member in self.members:
            member.cancel()
