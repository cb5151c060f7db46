"""What changed in the jobs this process runs, pushed to whoever streams them (``GET /v1/jobs/ID/events``).

Why: the event stream of a job should show its progress as it happens, without reading the store again
and again. The runner (:mod:`.runner`) calls :meth:`Changes.notify` when a job it runs is claimed, makes
progress, or ends, and keeps the newest progress of each (:attr:`Changes.progress`, written to the store
at most every :data:`~.runner.PROGRESS_WRITE_S`); a stream in the same process waits on
:meth:`Changes.wait`. A job that runs on another replica (a shared PostgreSQL store) is never notified
here: its stream falls back to reading the store every :data:`POLL_S`.
"""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["Changes", "POLL_S"]

POLL_S = 0.25        # how often a stream reads the store for a job that another replica may be running


class Changes:
    """Per-job wake-ups in one event loop (see the module docs)."""

    def __init__(self):
        self._events: dict[str, list] = {}     # job id -> [asyncio.Event, waiters]
        self.progress: dict[str, dict] = {}    # job id -> its newest progress (jobs running here)

    def notify(self, job_id: str) -> None:
        """Wake every stream waiting on ``job_id`` (each then looks at what changed)."""
        entry = self._events.pop(job_id, None)
        if entry is not None:
            entry[0].set()

    async def wait(self, job_id: str, timeout: float) -> bool:
        """Wait until ``job_id`` is notified (``True``) or ``timeout`` seconds pass (``False``)."""
        entry = self._events.get(job_id)
        if entry is None:
            entry = self._events[job_id] = [asyncio.Event(), 0]
        entry[1] += 1
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(entry[0].wait(), timeout)
            return entry[0].is_set()
        finally:
            entry[1] -= 1
            if entry[1] == 0 and self._events.get(job_id) is entry:
                del self._events[job_id]      # nobody waits any more: nothing to keep
