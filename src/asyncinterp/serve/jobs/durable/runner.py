"""The runner: claims kept jobs from the store, runs them on this server, writes each outcome once.

Why a loop of its own: a kept job runs whether or not anyone waits for it, after a restart too. One
runner per server (per replica) in the server's event loop:

* it claims jobs (:meth:`~.store.JobStore.claim`) while fewer than ``concurrency`` run here, and runs
  each as an asyncio task through its kind (:mod:`.kinds`); jobs run at once share the batcher's
  forwards like any requests;
* every ``lease / 3`` seconds it renews the leases of its jobs (:meth:`~.store.JobStore.heartbeat`);
  a job cancelled meanwhile (``DELETE /v1/jobs/ID``, on any replica) is cancelled here, which stops it
  at its next hook point as a disconnected client does; a job whose lease was lost (this server
  stalled past it and another took the job over) is dropped without writing anything;
* the outcome is written with :meth:`~.store.JobStore.finish` (a compare-and-set on the lease): once;
* a job's progress (every kind reports one: :mod:`.kinds`) is pushed at once to the event streams of this
  process (:mod:`.changes`) and written to the store at most every :data:`PROGRESS_WRITE_S` (what a status
  request, or a stream on another replica, reads);
* now and then it removes expired results (and expired files: ``sweeps``).

A server that dies leaves its jobs ``running`` with a lease that runs out; the next runner to claim
them (this server restarted, or another replica) runs them again from their start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket

from ....client import wire
from .. import errors
from .changes import Changes
from .kinds import KINDS
from .schema import CANCELLED, FAILED, SUCCEEDED

log = logging.getLogger("asyncinterp.serve.jobs")

# what a job may fail with (submitted code may raise even SystemExit): recorded as its failure
_JOB_ERRORS = (Exception, SystemExit, KeyboardInterrupt)
PROGRESS_WRITE_S = 0.5      # a running job's progress is written to the store at most this often


class Runner:
    """Runs the kept jobs of one server (see the module docs)."""

    def __init__(self, server, store, *, lease: float = 15.0, concurrency: int = 8, ttl: float | None = None,
                 running_per_owner: int | None = None, poll: float = 0.5, sweeps=()):
        self.server = server
        self.store = store
        self.lease = float(lease)
        self.concurrency = int(concurrency)
        self.ttl = ttl
        self.running_per_owner = running_per_owner
        self.poll = float(poll)
        self.sweeps = sweeps          # more to remove when it expires (files: serve/openai/batches)
        self.worker = f"{socket.gethostname()[:24]}-{os.getpid()}-{secrets.token_hex(4)}"
        self.tasks: dict[str, asyncio.Task] = {}
        self.stop_reason: dict[str, str] = {}
        self.wake = asyncio.Event()
        self.changes = Changes()
        self._loops: list[asyncio.Task] = []
        self.closing = False

    def start(self) -> None:
        self._loops = [asyncio.ensure_future(self._claim_loop()), asyncio.ensure_future(self._heartbeat_loop()),
                       asyncio.ensure_future(self._expire_loop())]

    async def aclose(self) -> None:
        """Stop claiming; cancel the jobs running here and give them back (another run starts them again)."""
        self.closing = True
        for t in self._loops:
            t.cancel()
        for jid, task in list(self.tasks.items()):
            self.stop_reason[jid] = "shutdown"
            task.cancel()
        await asyncio.gather(*self._loops, *self.tasks.values(), return_exceptions=True)

    # ------------------------------------------------------------------ loops
    async def _claim_loop(self):
        while not self.closing:
            try:
                free = self.concurrency - len(self.tasks)
                rows = await self.store.claim(self.worker, self.lease, free,
                                              running_per_owner=self.running_per_owner) if free > 0 else []
                for row in rows:
                    self.tasks[row["id"]] = asyncio.ensure_future(self._run(row))
                    self.changes.notify(row["id"])
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the database may be briefly unreachable: try again
                log.exception("claiming jobs failed", extra={"fields": {"event": "jobs", "worker": self.worker}})
                rows = []
            if rows and len(self.tasks) < self.concurrency:
                continue
            self.wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wake.wait(), self.poll)

    async def _heartbeat_loop(self):
        while not self.closing:
            await asyncio.sleep(self.lease / 3)
            try:
                await self.store.sync_clock(max_age=self.store.CLOCK_SYNC_S)   # leases on the database's clock
                states = await self.store.heartbeat(self.worker, list(self.tasks), self.lease)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001
                log.exception("renewing leases failed", extra={"fields": {"event": "jobs", "worker": self.worker}})
                continue
            for jid, state in states.items():
                task = self.tasks.get(jid)
                if state != "ok" and task is not None and jid not in self.stop_reason:
                    self.stop_reason[jid] = state
                    task.cancel()

    async def _expire_loop(self):
        while not self.closing:
            try:
                await self.store.expire()
                for sweep in self.sweeps:
                    await sweep()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001
                log.exception("removing expired results failed", extra={"fields": {"event": "jobs"}})
            await asyncio.sleep(60.0)

    # ------------------------------------------------------------------ one job
    async def _run(self, row):
        jid = row["id"]
        fields = {"event": "job", "job": jid, "kind": row["kind"], "attempt": row["attempts"], "worker": self.worker}
        writing = [None]         # the task writing this job's progress to the store (one at a time)

        def progress(p):
            self.changes.progress[jid] = p
            self.changes.notify(jid)
            if writing[0] is None or writing[0].done():
                writing[0] = asyncio.ensure_future(self._write_progress(jid))

        try:
            run = KINDS.get(row["kind"])
            try:
                if run is None:
                    raise errors.RequestFailed("request", f"this server runs no jobs of kind {row['kind']!r}")
                body = await self.store.request(row)
                answer = await run(self.server, body, row["timeout"], progress)
                # as the blocking client would read it (dtype names, numpy as tensors...), or its 422
                packed = wire.packb(answer)
                answer = wire.unpackb(packed, wire.answer_limits(len(packed)))
                failed = _first_failure(answer)
                state, error, status = (SUCCEEDED, None, None) if failed is None else (FAILED, *failed)
            except asyncio.CancelledError:
                why = self.stop_reason.get(jid)
                if why != "cancel":
                    fields["stopped"] = why
                    if why == "shutdown":
                        await self.store.release(jid, self.worker)
                    log.info("job stopped here", extra={"fields": fields})
                    return          # lost or shutting down: another run writes the outcome
                state, answer, status = CANCELLED, None, errors.status_of("cancelled")
                error = {"type": "RunCancelled", "message": "the job was cancelled (DELETE /v1/jobs/ID)",
                         "traceback": [], "notes": [], "kind": "cancelled"}
            except _JOB_ERRORS as exc:  # noqa: BLE001 - the job's own failure is its outcome
                fail = errors.failure(exc)
                state, answer, error, status = FAILED, None, fail.error, fail.status
            written = await self.store.finish(jid, self.worker, state, result=answer, error=error, status=status,
                                              ttl=self.ttl, progress=self.changes.progress.get(jid))
            fields.update(state=state, written=written)
            log.info("job ended", extra={"fields": fields})
        except asyncio.CancelledError:
            return
        except Exception:  # noqa: BLE001 - the store failed: the lease runs out and another run retries
            log.exception("job outcome not written", extra={"fields": fields})
        finally:
            if writing[0] is not None:
                writing[0].cancel()
            self.tasks.pop(jid, None)
            self.stop_reason.pop(jid, None)
            self.changes.progress.pop(jid, None)
            self.changes.notify(jid)
            self.wake.set()

    async def _write_progress(self, jid):
        """Write the job's newest progress now, then at most every PROGRESS_WRITE_S while it changes."""
        written = None
        while jid in self.tasks:
            p = self.changes.progress.get(jid)
            if p is None or p is written:
                return
            with contextlib.suppress(Exception):
                await self.store.set_progress(jid, self.worker, p)
            written = p
            await asyncio.sleep(PROGRESS_WRITE_S)


def _first_failure(answer):
    """``(error, status)`` of a job whose invokes failed (the first one's), else ``None``."""
    for entry in (answer or {}).get("results") or ():
        if isinstance(entry, dict) and not entry.get("ok", True):
            return entry.get("error"), entry.get("status") or errors.status_of("intervention")
    return None
