"""One worker process, the requests waiting for it, and the thread that watches it (a :class:`Pool`).

Why this module exists: everything a pool does happens on its own threads
and under its own lock: sending requests to the worker, reading its
messages, watching its heartbeat and its batch's hard deadline, killing it,
sorting the requests it held (blame, re-run alone, resend) and starting its
successor (from the fork server: no thread state inherited, :mod:`.worker_start`).
:class:`~.supervisor.Supervisor` owns one pool per trust class and only submits and cancels :class:`~..scheduling.submission.Submission` s (one per request); the policy (what is killed when,
who is blamed) is described in :mod:`.supervisor`.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import threading
import time

from ... import aio
from . import confine, worker_proc, worker_start
from ..jobs import errors
from ...client import wire
from . import worker_results
from ..scheduling.batcher import BatcherClosed, BatcherFull, GenerateResult
from ..scheduling.submission import Submission
from .channel import Channel, Heartbeat, Outbox, widen
from ..scheduling.worker_failures import Cause, RemoteFailure, WorkerUnavailable, cause_of_exit, failure_for

log = logging.getLogger("asyncinterp.serve.workers.supervisor")

def __getattr__(name):   # old names (Ticket: a submission): the compatibility table, asyncinterp.moved.RENAMED
    from ...moved import old_name
    return old_name(__name__, name)


TICK = 0.02           # seconds between a pool's checks of its worker
ACCEPTED = {"event": "accepted"}   # a remote job's first event: the worker read and checked it, and its batch began


class WorkerHandle:
    """A worker process as its pool sees it: process, pipe, heartbeat, and the jobs it holds."""

    def __init__(self, proc, channel: Channel, heartbeat: Heartbeat, born: float):
        self.proc = proc
        self.channel = channel
        self.heartbeat = heartbeat
        self.born = born
        self.ready = False
        self.doomed = False           # judged dead (or being retired): nothing more is sent or believed
        self.broken = None            # why its pipe failed, if it did
        self.kill_cause = None
        self.jobs = {}                # id -> Submission sent to it and not answered
        self.batch = []               # ids of the batch it is running (empty between batches)
        self.batch_started = None
        self.batch_deadline = None    # the running batch's hard deadline (time.monotonic())
        self.beat_seen = -1
        self.beat_at = born
        self.outbox = Outbox(channel)  # what is sent to it (written at once when its pipe takes it)
        self.told_arriving = False    # whether it was last told that requests are on their way (relay_arrivals)
        self.threads = []             # its reader and sender threads

    def close_pipe(self) -> None:
        """Close the server's end once its threads are gone (so a reused descriptor number is never touched)."""
        self.outbox.put(None)
        for t in self.threads:
            t.join(2.0)
        try:
            self.channel.close()
        except OSError:
            pass
        self.heartbeat.close()


#: the messages whose handling wakes the server's event loop (an answer, an event, a job's acceptance)
_HANDED_TO_LOOP = frozenset({"done", "event", "batch"})


def reap(proc, timeout: float) -> None:
    """Wait until ``proc`` has exited (and is collected), at most ``timeout`` seconds.

    Polls ``waitpid`` rather than ``proc.join(timeout)``: join waits for the
    process's sentinel pipe to close, and a worker forked later holds a copy
    of it, so join would wait out its whole timeout.
    """
    deadline = time.monotonic() + timeout
    while proc.is_alive() and time.monotonic() < deadline:
        time.sleep(0.005)


class Pool:
    """One worker process, the requests waiting for it, and the thread that watches it."""

    def __init__(self, supervisor, name: str, nice: int):
        self.sup = supervisor
        self.name = name
        self.nice = nice
        self.cond = threading.Condition()
        self.waiting = collections.deque()
        self.suspects = collections.deque()
        self.worker = None
        self.solo = None              # the suspect now re-run alone
        self.thread = None
        self.closed = False
        self.wanted = False           # start a worker even with nothing to do (Supervisor.start)
        self.stale = False            # registrations changed since the worker started: replace it when idle
        self.forked_names = None      # the interventions registered when the worker started (it has those)
        self.forked_edits = None      # the named edits installed when the worker started (model_names)
        self.arriving = 0             # requests on their way to the server (relay_arrivals)
        self.failed_starts = 0
        self.restarts = 0
        self.restart_began = None
        self.restart_times = collections.deque(maxlen=50)

    def runs_code(self) -> bool:
        """Whether this pool's worker runs submitted code: the ``code`` pool's, or the one pool's when submitted
        code has no worker of its own. Another worker refuses submitted code it is sent (a routing error)."""
        return self.name == "code" or "code" not in self.sup.pools

    # ------------------------------------------------------------------ from the event loops
    def submit(self, job: Submission) -> None:
        with self.cond:
            if self.closed:
                raise BatcherClosed("the server is shutting down")
            if self.queue_size() >= self.sup.max_queue:
                raise BatcherFull(f"{self.queue_size()} requests are waiting (max_queue={self.sup.max_queue}); "
                                  "try again later")
            job.pool = self
            self.waiting.append(job)
            self.ensure_thread()
            self._dispatch()
            if self.waiting:            # not sent (no worker ready yet): the watch starts one or sends it later
                self.cond.notify_all()

    def relay_arrivals(self, count: int) -> None:
        """Tell the worker how many requests are on their way to the server (its batches wait only for those).

        Only a worker that holds requests hears it at once (only a batch can wait); an idle one hears it with
        its next request (:meth:`_send`), so a lone request costs the worker no message but its own."""
        with self.cond:
            self.arriving = count
            w = self.worker
            if w is not None and w.jobs:
                self._tell_arrivals(w)

    def _tell_arrivals(self, w: WorkerHandle) -> None:   # under the lock
        some = self.arriving > 0
        if w.ready and not w.doomed and w.told_arriving != some:
            w.told_arriving = some
            w.outbox.put(wire.packb({"op": "arrivals", "n": self.arriving}))

    def edits_installed(self, names) -> None:
        """A request runs the named edits ``names``: a worker forked before one of them was installed has not
        got it, and is replaced when idle (the request waits for its successor)."""
        with self.cond:
            if self.forked_edits is not None and not set(names) <= self.forked_edits:
                self.stale = True

    def cancel(self, job: Submission) -> None:
        with self.cond:
            state = job.state
            if state in ("done", "cancelled"):
                return
            job.state = "cancelled"
            for q in (self.waiting, self.suspects):
                try:
                    q.remove(job)
                except ValueError:
                    pass
            w = job.worker
            if state in ("sent", "running") and w is not None and not w.doomed:
                w.outbox.put(wire.packb({"op": "cancel", "id": job.id}))   # it answers, then the job is let go

    def queue_size(self) -> int:
        w = self.worker
        sent = sum(1 for j in list(w.jobs.values()) if j.state == "sent") if w is not None else 0
        return len(self.waiting) + len(self.suspects) + sent

    # ------------------------------------------------------------------ sending (under the lock)
    def want_worker(self) -> None:
        """Start a worker even with nothing to do (:meth:`Supervisor.start`)."""
        with self.cond:
            self.wanted = True
            self.ensure_thread()
            self.cond.notify_all()

    def ensure_thread(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._watch, name=f"asyncinterp-supervisor-{self.name}",
                                           daemon=True)
            self.thread.start()

    def _dispatch(self) -> None:
        w = self.worker
        if w is None or not w.ready or w.doomed or self.solo is not None:
            return
        if self.suspects:
            job = self.suspects.popleft()
            self.solo = job
            self._send(w, job, alone=True)
            return
        if self.stale:
            return
        while self.waiting:
            self._send(w, self.waiting.popleft())

    def _send(self, w: WorkerHandle, job: Submission, alone: bool = False) -> None:
        job.state = "sent"
        job.worker = w
        w.jobs[job.id] = job
        if job.forwarded:                       # its first run streamed events that a re-run will repeat
            job.mailbox.put(("event", True, {"event": "restart"}))
            job.forwarded = 0
        self._tell_arrivals(w)
        w.outbox.put(wire.packb(dict(job.fields, alone=True)) if alone else job.wire)

    # ------------------------------------------------------------------ from the worker (reader thread)
    def _read(self, w: WorkerHandle) -> None:
        why = "the pipe closed"
        try:
            while True:
                msg = w.channel.recv()
                with self.cond:
                    if not self._on_message(w, msg):
                        why = f"sent an invalid message ({str(msg)[:200]})"
                        break
                if msg.get("t") in _HANDED_TO_LOOP:
                    # the event loop was just woken for it: let it take the GIL now (it would wait while this
                    # thread reads and applies the next message, e.g. the batch_end that came in the same write)
                    time.sleep(0)
        except EOFError:
            pass
        except (OSError, wire.WireError, ValueError) as exc:
            why = f"{type(exc).__name__}: {str(exc)[:200]}"
        with self.cond:
            w.broken = w.broken or why
            self.cond.notify_all()

    def _send_loop(self, w: WorkerHandle) -> None:
        try:
            w.outbox.run()
        except (OSError, ValueError) as exc:
            with self.cond:
                w.broken = w.broken or f"cannot write to its pipe ({exc})"
                self.cond.notify_all()

    def _on_message(self, w: WorkerHandle, msg: dict) -> bool:
        """Apply one message (under the lock); ``False`` if it is not a valid message."""
        if w.doomed:
            return True
        t = msg.get("t")
        jid = msg.get("id")
        if t == "ready":
            w.ready = True
            w.confined = bool(msg.get("confined"))
            w.threads_at_start = msg.get("threads")
            self.failed_starts = 0
            if self.restart_began is not None:
                self.restart_times.append(time.monotonic() - self.restart_began)
                self.sup.count("restart_seconds", self.restart_times[-1])
                self.restart_began = None
            self._dispatch()
        elif t == "batch":
            ids = msg.get("ids")
            if not isinstance(ids, list):
                return False
            now = time.monotonic()
            jobs = [w.jobs[i] for i in ids if isinstance(i, int) and i in w.jobs]
            w.batch = [j.id for j in jobs]
            w.batch_started = now
            w.batch_deadline = now + max((j.timeout for j in jobs), default=0.0) + sum(j.code_budget for j in jobs) \
                + self.sup.options.hang_timeout
            for j in jobs:
                if j.state == "sent":
                    j.state = "running"
                if j.stream and j.kind == "job":   # a streamed remote job is accepted as its batch starts
                    j.mailbox.put(("event", True, ACCEPTED))
            self.sup.count("batches")
            self.sup.count("requests", len(jobs))
        elif t == "batch_end":
            w.batch = []
            w.batch_started = w.batch_deadline = None
        elif t == "event":
            ev = msg.get("event")
            if not (isinstance(ev, dict) and ev.get("event") in ("token", "emit", "restart", "error", "accepted")):
                return False
            j = w.jobs.get(jid)
            if j is not None and j.state in ("sent", "running"):
                j.forwarded += ev.get("event") != "accepted"   # (what a re-run repeats: not its acceptance)
                j.mailbox.put(("event", True, ev))
        elif t == "done":
            j = w.jobs.pop(jid, None)
            if j is None:                       # a request it no longer holds (cancelled): ignore
                return isinstance(jid, int)
            if j is self.solo:
                self.solo = None
            if msg.get("ok") is True:
                value = msg.get("value")
                if j.kind == "generate":
                    if not isinstance(value, dict):
                        return False
                    emitted = value.get("emitted") if isinstance(value.get("emitted"), list) else []
                    try:
                        extras = worker_results.generation_extras(value)   # logprobs, cached tokens
                    except ValueError:
                        return False
                    value = GenerateResult(value.get("result"), value.get("tokens"), value.get("text"), emitted,
                                           *extras)
                j.answer(True, value)
            else:
                error = msg.get("error")
                status = msg.get("status")
                if not isinstance(error, dict) or not isinstance(status, int):
                    return False
                error = {"type": str(error.get("type", "Error"))[:200], "message": str(error.get("message", "")),
                         "traceback": [str(x) for x in error.get("traceback") or []][:200],
                         "notes": [str(x) for x in error.get("notes") or []][:50],
                         "kind": str(error.get("kind", "intervention"))[:50]}
                j.answer(False, RemoteFailure(errors.checked_status(status), error))
            self._dispatch()
        elif t == "oom":
            log.info("worker %s (pid %s): request %s ran out of memory", self.name, w.proc.pid, jid)
        else:
            return False
        return True

    # ------------------------------------------------------------------ the watch
    def _watch(self) -> None:
        while True:
            with self.cond:
                if self.closed:
                    return
                action = self._inspect(time.monotonic())
                if action is None:
                    self.cond.wait(TICK)
                    continue
            try:
                action()
            except Exception:  # noqa: BLE001 - the watch must go on
                log.exception("supervisor of the %s worker: an action failed", self.name)
                time.sleep(TICK)

    def _inspect(self, now):
        """What to do now (under the lock): a callable, or ``None`` (wait a tick)."""
        w = self.worker
        opts = self.sup.options
        if w is None:
            if self.waiting or self.suspects or self.wanted:
                return self._start
            return None
        if w.broken is not None or not w.proc.is_alive():
            return lambda: self._bury(w, None)
        beat = w.heartbeat.read()
        if beat != w.beat_seen:
            w.beat_seen = beat
            w.beat_at = now
        if not w.ready:
            if now - w.born > opts.start_timeout:
                return lambda: self._kill(w, Cause("start", f"was not ready after {opts.start_timeout:g} s"))
            return None
        if now - w.beat_at > opts.hang_timeout:
            return lambda: self._kill(w, Cause("hung", f"made no progress for {now - w.beat_at:.1f} s"))
        if w.batch_deadline is not None and now > w.batch_deadline:
            return lambda: self._kill(w, Cause(
                "overran", f"was still running its batch {now - w.batch_started:.1f} s after it started, past the "
                           "batch's hard deadline (its longest time limit, its compute budgets and a grace of "
                           f"{opts.hang_timeout:g} s)"))
        if self.stale and not w.jobs:
            return lambda: self._retire(w)
        if self.waiting or self.suspects:
            self._dispatch()                # normally done as requests come and go; this is the safety net
        return None

    def _start(self) -> None:
        sup = self.sup
        with self.cond:
            if self.closed or self.worker is not None:
                return
            if self.failed_starts >= sup.options.max_failed_starts:
                self._fail_waiting(WorkerUnavailable(
                    f"the {self.name} worker process failed to start {self.failed_starts} times in a row (see the "
                    "server's log); the server will try again with the next request"))
                self.failed_starts = 0
                self.wanted = False
                return
            self.forked_names = set(sup.server.interventions)
            self.forked_edits = set(sup.server.names.edits)
            self.stale = False
        try:
            # the registrations as they are now, taken in the server's event loop (where they change); pickled
            # here, on this pool's thread, so that the event loop is not held up by it
            state = sup.in_server_loop(lambda: worker_start.snapshot(sup.server))
            w = self._spawn(worker_start.pack_server(sup.server, state))
        except Exception as exc:  # noqa: BLE001 - counted as a failed start; the watch tries again
            log.error("cannot start the %s worker process: %s: %s", self.name, type(exc).__name__, exc)
            with self.cond:
                self.failed_starts += 1
            time.sleep(min(1.0, 0.1 * self.failed_starts))
            return
        for target, role in ((self._read, "reader"), (self._send_loop, "sender")):
            t = threading.Thread(target=target, args=(w,), name=f"asyncinterp-{role}-{self.name}", daemon=True)
            w.threads.append(t)
            t.start()
        with self.cond:
            if self.closed:
                w.doomed = True
            else:
                self.worker = w
                self._dispatch()            # its "ready" may have been read before this line
                self.cond.notify_all()
        if w.doomed:
            self._stop_process(w, 1.0)
        log.info("started the %s worker process (pid %s)", self.name, w.proc.pid)

    def _spawn(self, packed) -> WorkerHandle:
        """Start a worker that receives ``packed`` (the server, :func:`~.worker_start.pack_server`).

        The process comes from the fork server (:mod:`.worker_start`): it inherits no thread of this process
        and no lock, so no lock needs holding; its weights are views of the shared block that goes with it.
        """
        sup = self.sup
        ctx = worker_start.context(sup.server.model)
        parent_end, child_end = ctx.Pipe(duplex=True)
        for end in (parent_end, child_end):
            widen(end)
        heartbeat = Heartbeat()
        settings = {"server_pid": os.getpid(), "nice": self.nice, "memory_limit": sup.options.memory_limit,
                    "batcher": dict(sup.batcher_options, name=f"worker-{self.name}"),
                    "confine": confine.wanted_for(self), "runs_code": self.runs_code(),
                    **worker_start.process_settings()}
        proc = ctx.Process(target=worker_proc.run, args=(child_end, heartbeat, packed, settings),
                           name=f"asyncinterp-worker-{self.name}", daemon=True)
        born = time.monotonic()
        try:
            proc.start()
        finally:
            child_end.close()
        return WorkerHandle(proc, Channel(parent_end), heartbeat, born)

    def _kill(self, w: WorkerHandle, cause: Cause) -> None:
        with self.cond:
            w.doomed = True
            w.kill_cause = cause
            if self.restart_began is None:
                self.restart_began = time.monotonic()
        try:
            os.kill(w.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, OSError):
            pass
        self._bury(w, cause)

    def _bury(self, w: WorkerHandle, cause: Cause | None) -> None:
        """The worker is dead (or broken): collect it, sort its jobs, blame an offender, start afresh."""
        with self.cond:
            w.doomed = True
            if self.restart_began is None:
                self.restart_began = time.monotonic()
        reap(w.proc, 2.0)
        if w.proc.is_alive():           # broken but running: finish it
            try:
                os.kill(w.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, OSError):
                pass
            reap(w.proc, 5.0)
        if cause is None:
            cause = w.kill_cause or cause_of_exit(w.proc.exitcode, w.broken)
        w.close_pipe()
        with self.cond:
            self._sort(w, cause)
            if self.worker is w:
                self.worker = None
            self.cond.notify_all()

    def _sort(self, w: WorkerHandle, cause: Cause) -> None:
        """Blame, re-run alone or resend the jobs of dead worker ``w`` (under the lock)."""
        sup = self.sup
        sup.count("restarts")
        sup.count(cause.kind)
        self.restarts += 1
        if not w.ready:
            self.failed_starts += 1
        jobs = [j for j in w.jobs.values() if j.state != "cancelled"]
        w.jobs.clear()
        running = set(w.batch)
        suspects = [j for j in jobs if j.id in running and j.state == "running"]
        others = [j for j in jobs if j not in suspects]
        blamed = None
        if len(suspects) == 1 and len(w.batch) == 1:        # it ran alone: it is the offender
            blamed = suspects[0]
            sup.count("blamed")
            blamed.answer(False, failure_for(cause, sup.options, blamed.suspect))
        else:
            for j in suspects:
                j.suspect = True
            sup.count("reruns", len(suspects))
        for j in reversed(others):
            j.state = "queued"
            (self.suspects if j.suspect else self.waiting).appendleft(j)
        if blamed is None:
            for j in reversed(suspects):
                j.state = "queued"
                self.suspects.appendleft(j)
        self.solo = None
        log.warning("the %s worker process (pid %s) %s; %s", self.name, w.proc.pid, cause.detail,
                    f"request {blamed.id} ran alone and failed" if blamed is not None else
                    f"re-running {len(suspects)} request(s) of its batch one by one, resending {len(others)}",
                    extra={"fields": {"event": "worker_restart", "pool": self.name, "cause": cause.kind,
                                      "suspects": len(suspects), "resent": len(others),
                                      "blamed": blamed is not None}})

    def _retire(self, w: WorkerHandle) -> None:
        """Replace an idle worker (interventions or edits were installed after it was forked)."""
        with self.cond:
            if w.jobs or self.worker is not w:
                return
            w.doomed = True
            self.worker = None
        self._stop_process(w, 5.0)
        log.info("replaced the %s worker process: interventions or edits were installed after it started", self.name)

    def _stop_process(self, w: WorkerHandle, wait: float) -> None:
        try:
            w.outbox.put(wire.packb({"op": "exit"}))
        except Exception:  # noqa: BLE001
            pass
        reap(w.proc, wait)
        if w.proc.is_alive():
            try:
                os.kill(w.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, OSError):
                pass
            reap(w.proc, 5.0)
        w.close_pipe()

    def _fail_waiting(self, exc) -> None:
        for q in (self.waiting, self.suspects):
            while q:
                q.popleft().answer(False, exc)

    # ------------------------------------------------------------------ shutdown
    def close(self, timeout: float) -> None:
        with self.cond:
            self.closed = True
            self._fail_waiting(BatcherClosed("the server shut down before this request ran"))
            w = self.worker
            self.worker = None
            if w is not None:
                w.doomed = True
                for j in list(w.jobs.values()):
                    j.answer(False, BatcherClosed("the server shut down while this request ran"))
                w.jobs.clear()
            self.cond.notify_all()
        if w is not None:
            self._stop_process(w, timeout)
        t = self.thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    def describe(self) -> dict:
        w = self.worker
        times = list(self.restart_times)
        return {"pid": w.proc.pid if w is not None else None, "ready": bool(w is not None and w.ready),
                "restarts": self.restarts, "waiting": len(self.waiting), "rerunning": len(self.suspects),
                "last_restart_ms": round(1000 * times[-1], 1) if times else None,
                "confined": bool(w is not None and getattr(w, "confined", False))}
