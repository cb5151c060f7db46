"""The worker process: the model, a normal :class:`~.batcher.Batcher` and the requests' interventions.

Why a process: a C-level loop that never releases the GIL (``any(iter(int, 1))``
in submitted code), a crash (a segfault, ``abort``, heap corruption) or runaway
memory cannot be stopped or survived inside the process that runs it. Run in
a child, they can: the server (:mod:`.supervisor`) watches the child, kills
it, starts a new one and re-runs the innocent requests, while its own event
loop keeps answering.

The child is started from multiprocessing's fork server, never forked from
the server itself, so it inherits no thread state (:mod:`.worker_start`):
it receives the server as a value (the model, whose weights it maps from
the server's shared memory, the registered interventions and named edits,
the limits) and torch's settings, so it starts in a fraction of a second.
Before it serves, it: dies with the server (``PR_SET_PDEATHSIG`` on its
parent, the fork server, which ends with the server; and it checks that the
server lives), ignores Ctrl-C (the server shuts it down), replaces the
sockets it inherited (the fork server's) with ``/dev/null``, lowers its CPU
priority if asked (the submitted-code worker), caps its memory with an
rlimit (``RLIMIT_DATA``: its size at start plus ``memory_limit`` bytes) and,
if it runs submitted code, confines itself with seccomp (:mod:`.confine`).

Protocol (msgpack maps, see :mod:`.channel`). Server to worker:
``{"op": "run", "id", "kind": "trace"|"generate"|"session", "input", "spec", "timeout",
"max_new_tokens", "stream", "gen", "edits"?, "session"?, "alone"?}`` (``edits``: the names
of installed edits, :mod:`.model_names`, run before the spec's intervention) (``session``:
see :mod:`.sessions`) (``alone``: a re-run that the server sends by itself; the batcher does
not wait for company), ``{"op": "cancel", "id"}``,
``{"op": "exit"}``. Worker to server: ``{"t": "ready", "pid", "confined", "threads"}`` (``threads``: the
process's threads when it started, before its own: 1);
``{"t": "batch", "ids"}`` from the batcher's thread just before a batch
starts (before any of its code runs; for a streamed remote job, also its
acceptance) and ``{"t": "batch_end"}`` when it has ended (written with the
batch's last answer when a job's reply is that answer); ``{"t": "event", "id", "event"}``
(``token``/``emit``/``restart``, as produced); ``{"t": "done", "id", "ok":
true, "value"}`` (a generation's ``value`` also carries its log-probabilities,
see :mod:`.worker_results`) or ``{"t": "done", "id", "ok": false, "status", "error"}``
(one per request, also after a cancel); ``{"t": "oom", "id"}`` and then exit
status :data:`OOM_EXIT` when a request ran out of memory.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import stat
import sys
import threading

from ... import aio
from . import confine, worker_results, worker_start
from ..jobs import errors
from ..jobs.job_wire import read_job
from ..scheduling.submission import Envelope
from ...client import wire
from ..scheduling.batcher import Batcher, Meter
from .channel import Channel
from ..sandbox import SandboxTimeout
from ..scheduling.worker_failures import FAILED_EXIT, OOM_EXIT

log = logging.getLogger("asyncinterp.serve.worker")

BEAT_INTERVAL = 0.01   # seconds between heartbeats
BATCH_END = wire.packb({"t": "batch_end"})

# what a request may fail with (an intervention may raise even SystemExit/KeyboardInterrupt)
_ERRORS = (Exception, SandboxTimeout, SystemExit, KeyboardInterrupt)


def run(conn, heartbeat, server, settings: dict) -> None:
    """Entry point of a worker (a ``multiprocessing`` target; ``server`` arrives unpickled, see
    :mod:`.worker_start`): prepare, serve, exit."""
    settings = dict(settings, threads_at_start=_thread_count())   # 1: nothing inherited runs (said in "ready")
    box = {"code": FAILED_EXIT}

    def serve():
        try:
            Worker(Channel(conn), server, settings).serve()
            box["code"] = 0
        except MemoryError:
            box["code"] = OOM_EXIT
        except BaseException:  # noqa: BLE001 - report, then exit with a status the supervisor explains
            log.exception("the worker process failed")

    try:
        prepare(settings, conn.fileno())
        if settings.get("confine"):   # last: after the seals and limits, with torch loaded and the pipe open
            confine.install()         # fails closed: a worker that should be confined and is not never serves
        threading.Thread(target=heartbeat.beat_forever, args=(BEAT_INTERVAL,), daemon=True,
                         name="asyncinterp-heartbeat").start()
        # the event loop in a thread of its own, as the batcher's callers run in the server
        t = threading.Thread(target=serve, name="asyncinterp-worker")
        t.start()
        t.join()
    except MemoryError:
        box["code"] = OOM_EXIT
    except BaseException:  # noqa: BLE001
        log.exception("the worker process failed to start")
    code = box["code"]
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


# --------------------------------------------------------------------------- process setup
def prepare(settings: dict, keep_fd: int) -> None:
    """Make this fresh process a worker: tie it to the server, seal what it inherited, set torch and limits."""
    _die_with_parent(settings["server_pid"])
    worker_start.apply_settings(settings)
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C goes to the server, which shuts workers down
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    faulthandler.disable()   # a fatal signal kills at once (no inherited traceback dump delaying the crash report)
    faulthandler.register(signal.SIGUSR1, all_threads=True)   # `kill -USR1 PID`: every thread's stack on stderr
    _seal_sockets(keep_fd)
    if settings.get("nice"):
        os.nice(settings["nice"])
    if settings.get("memory_limit"):
        _limit_memory(settings["memory_limit"])


def _die_with_parent(server_pid: int) -> None:
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)   # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass
    # our parent is the fork server, which ends when the server does; the server may have died already
    try:
        os.kill(server_pid, 0)
    except ProcessLookupError:
        os._exit(0)
    except OSError:
        pass
    if os.getppid() == 1:
        os._exit(0)


def _seal_sockets(keep_fd: int) -> None:
    """Replace every inherited socket but our pipe (and stdio) by ``/dev/null`` at the same number.

    The descriptor numbers stay taken, so a stale object that closes its old
    number later closes a ``/dev/null`` descriptor, never one of ours.
    """
    try:
        fds = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        return
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in fds:
            if fd in (keep_fd, null) or fd <= 2:
                continue
            try:
                if stat.S_ISSOCK(os.fstat(fd).st_mode):
                    os.dup2(null, fd)
            except OSError:
                pass
    finally:
        os.close(null)


def _thread_count() -> int | None:
    """The threads of this process, as the kernel counts them (``/proc/self/task``; Linux)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def vm_data() -> int | None:
    """This process's data segment (heap and private anonymous mappings) in bytes, from /proc (Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _limit_memory(extra: int) -> None:
    import resource
    which = getattr(resource, "RLIMIT_DATA", None)
    base = vm_data()
    if which is None or base is None:
        log.warning("cannot limit the worker's memory on this platform (no RLIMIT_DATA or /proc)")
        return
    limit = base + int(extra)
    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(which, (limit, limit))    # hard too: code in the worker cannot raise it again


# --------------------------------------------------------------------------- serving
class _ReportingBatcher(Batcher):
    """A Batcher that reports which requests a batch holds before any of their code runs, and its end.

    A batch in which a request ran out of memory ends the process before its
    end is reported: the server then re-runs its requests one by one.
    """

    def __init__(self, model, on_batch, on_batch_end, on_out_of_memory, **kwargs):
        super().__init__(model, **kwargs)
        self.on_batch = on_batch
        self.on_batch_end = on_batch_end
        self.on_out_of_memory = on_out_of_memory

    def _execute(self, batch):
        self.on_batch(batch)
        try:
            return super()._execute(batch)
        finally:
            for r in batch:
                for kind, ok, value in list(r.mailbox.items):   # what it delivered, not yet sent on
                    if kind == "done" and not ok and is_out_of_memory(value):
                        self.on_out_of_memory(r)
            self.on_batch_end()


class Worker:
    """Serve the server's requests on a :class:`Batcher` until the pipe closes or the server says ``exit``."""

    def __init__(self, channel: Channel, server, settings: dict):
        self.channel = channel
        self.server = server
        self.settings = settings
        self.runs_code = settings.get("runs_code", True)   # see Pool.runs_code
        self.tags = {}      # Meter -> request id: the batcher's requests carry the meter given to them
        self.scopes = {}    # request id -> its cancel scope
        self.live = 0       # requests received whose task has not ended
        self.unanswered = set()   # ids of the running batch not answered yet by reply_done (batcher's thread)
        self.end_told = False     # the running batch's end went out already, with its last answer
        self.waiting = aio.Readiness(channel.fileno())   # the event loop's wait for the pipe, while requests are live
        self.ended = False  # told to exit (or the pipe closed) while a request ran in the loop's main task
        self.batcher = _ReportingBatcher(server.model, self._batch_started, self._batch_ended,
                                         lambda r: self._out_of_memory(self.tags.get(r.meter)), **settings["batcher"])
        server.batcher = self.batcher   # what the server's code reads of its batcher here (max_batch, ...)
        self.max_wait = self.batcher.max_wait

    def serve(self) -> None:
        aio.run_with_tasks(self._main)

    async def _main(self, start):
        self.channel.send({"t": "ready", "pid": os.getpid(), "confined": confine.status_of().get("seccomp") == 2,
                           "threads": self.settings.get("threads_at_start")})
        while not self.ended:
            try:
                msg = await self._next_message()
            except (EOFError, OSError):
                break
            if msg is None:     # the last live request ended: wait the idle way
                continue
            if msg.get("op") == "run" and not self.live:
                await self._run_here(msg, start)
            elif not self._apply(msg, start):
                break
        self._cancel_all()
        await aio.to_thread(self.batcher.close)

    def _cancel_all(self) -> None:
        for scope in list(self.scopes.values()):
            scope.cancel()

    def _apply(self, msg, start) -> bool:
        """One message of the server, as it arrives; ``False``: stop serving (``exit``)."""
        op = msg.get("op")
        if op == "run":
            self.live += 1
            start(self._arriving, msg, self._begin(msg))
        elif op == "arrivals":
            self.batcher.arrivals.relay(msg.get("n", 0))
        elif op == "cancel":
            scope = self.scopes.get(msg.get("id"))
            if scope is not None:
                scope.cancel()
        elif op == "exit":
            return False
        return True

    async def _run_here(self, msg, start) -> None:
        """A request that arrives with none live, run in this loop's main task rather than a task of its own
        (its forward starts without waiting for that task to be scheduled). Meanwhile a reader callback hears
        the pipe: cancels, arrivals, and requests that come now (those get tasks of their own); an ``exit``
        or a closed pipe cancels what runs and ends serving."""
        import asyncio
        loop = asyncio.get_running_loop()
        fd = self.channel.fileno()

        def readable():
            try:
                more = self._apply(self.channel.recv(True), start)
            except (EOFError, OSError):
                more = False
            if not more:
                self.ended = True
                loop.remove_reader(fd)
                self._cancel_all()

        self.live += 1
        begun = self._begin(msg)
        loop.add_reader(fd, readable)
        try:
            await self._arriving(msg, begun)
        finally:
            loop.remove_reader(fd)

    def _batch_started(self, batch) -> None:   # on the batcher's thread
        ids = [i for i in (self.tags.get(r.meter) for r in batch if r.state == "queued") if i is not None]
        self.unanswered = set(ids)
        self.end_told = False
        self.channel.send({"t": "batch", "ids": ids})

    def _batch_ended(self) -> None:   # on the batcher's thread
        if not self.end_told:
            self.channel.send({"t": "batch_end"})

    async def _next_message(self):
        """The server's next message; ``None`` if the wait was ended because no request is live any more.

        The server writes each message whole, so one that is readable is read at once, in this loop (no
        thread hop). With no request live, nothing else can happen in this loop until the server writes: the
        wait is then a plain blocking read, without the event loop's wait for the descriptor and its wake-up
        (the first request after a pause is read as soon as it arrives)."""
        if not self.live:
            return self.channel.recv(True)
        if await self.waiting.wait():
            return self.channel.recv(True)
        return None     # ended by the last live request as it ended (_arriving)

    def _begin(self, msg):
        """A remote job's part before its forward, done as its message arrives (read, checked, tokenized and
        submitted here, in this loop's own turn; its task awaits the rest): ``finish``, the coroutine function
        that awaits its reply, or the reply of a job refused on the way; ``None`` for other requests.

        Its cancel scope is made here, so that a cancel that comes before its task runs is not lost."""
        if msg.get("kind") != "job":
            return None
        jid = msg["id"]
        self.scopes[jid] = aio.cancel_scope()
        if msg.get("alone"):   # the server sends nothing else until it is answered: no company will come
            self.batcher.max_wait = 0.0
        with self.batcher.arrivals.expect():   # on its way to the batcher until it is submitted
            try:
                from ..jobs import jobs_api
                return jobs_api.begin_in_worker(self, jid, msg, float(msg["timeout"]))
            except _ERRORS as exc:
                return self._failure(jid, exc)

    async def _arriving(self, msg, begun=None) -> None:
        try:
            if begun is not None:   # submitted already (or refused): nothing of it is on its way
                await self._run(msg, begun)
            else:
                with self.batcher.arrivals.expect():   # on its way to the batcher until it is submitted
                    await self._run(msg)
        finally:
            self.live -= 1
            if not self.live:
                self.waiting.end()

    async def _run(self, msg, begun=None) -> None:
        jid = msg["id"]
        kind = msg["kind"]
        timeout = float(msg["timeout"])
        job = on_cancel = meter = None
        if kind == "trace" or kind == "generate":
            try:
                job, on_cancel, meter = self._read(msg["job"], timeout)
            except _ERRORS as exc:   # the server checked the job already: unexpected, but only this request fails
                self._reply(self._failure(jid, exc))
                return
        meter = meter if meter is not None else Meter()
        self.tags[meter] = jid
        alone = bool(msg.get("alone"))
        if alone and begun is None:   # no company will come (a job begun as it came: _begin set it already)
            self.batcher.max_wait = 0.0
        reply = None
        scope = self.scopes.get(jid) or aio.cancel_scope()   # (made by _begin, for a job begun as it came)
        self.scopes[jid] = scope
        with scope:
            try:
                if begun is not None:
                    reply = begun if isinstance(begun, dict) else await begun()
                else:
                    reply = await self._call(jid, kind, msg, job, timeout,
                                             Envelope(None, meter, timeout, None, on_cancel))
            except _ERRORS as exc:
                reply = self._failure(jid, exc)
            finally:
                self.scopes.pop(jid, None)
                self.tags.pop(meter, None)
                if alone:
                    self.batcher.max_wait = self.max_wait
        if reply is self.REPLIED:   # answered already, from the thread that ran it (jobs_api.begin_in_worker)
            return
        if reply is None:   # cancelled by the server
            reply = {"t": "done", "id": jid, "ok": False, "cancelled": True,
                     "status": errors.status_of("client_disconnect"),
                     "error": {"type": "Cancelled", "message": "cancelled", "traceback": [], "notes": []}}
        self._reply(reply)

    def _read(self, data: bytes, timeout: float):
        """A request's job as the server sent it (:func:`~..jobs.job_wire.served_job`), its interventions bound
        here: ``(job parts, on_cancel, meter)`` (the meter and canceller of its submitted code, if any)."""
        bound = {}

        def bind(spec):
            fn, on_cancel, _, meter = self.server.bind_intervention(spec, timeout)
            if meter is not None:
                bound.update(on_cancel=on_cancel, meter=meter)
            return fn
        job = read_job(data, compile=bind, named=bind, edit=self._edit)
        return job, bound.get("on_cancel"), bound.get("meter")

    def _edit(self, name):
        """The function of the named edit ``name`` (:mod:`.model_names`), as installed when this worker started."""
        edit = self.server.names.edits.get(name)
        if edit is None:   # the supervisor replaces a worker started before an edit was installed: unexpected
            raise LookupError(f"this worker process has no edit named {name!r}")
        return edit.fn

    async def _call(self, jid, kind, msg, job, timeout, envelope):
        batcher = self.batcher   # (never a remote job: _begin submitted it, and _run awaits its finish)
        if kind == "session":     # serve/jobs/sessions.py: its traces are this worker's requests, tagged with its id
            from ..jobs.sessions import load_session
            run = load_session(self.server, msg.get("session") or {}, batcher, timeout)
            self.tags[run.clock] = jid
            try:
                return {"t": "done", "id": jid, "ok": True, "value": await run()}
            finally:
                self.tags.pop(run.clock, None)
        if kind == "trace":
            value = await batcher.answer(batcher.start(job, envelope, single=True))
            return {"t": "done", "id": jid, "ok": True, "value": value}
        if msg.get("stream"):
            stream = batcher.events(batcher.start(job, envelope, single=True, stream=True))
            try:
                async for ev in stream:
                    if ev["event"] == "done":
                        return _generated(jid, ev["result"])
                    self._event(jid, ev)
            finally:
                await stream.aclose()
        return _generated(jid, await batcher.answer(batcher.start(job, envelope, single=True)))

    def _event(self, jid, ev) -> None:
        try:
            data = wire.packb({"t": "event", "id": jid, "event": ev})
        except wire.WireError as exc:   # as the in-process server does: this event becomes an error event
            data = wire.packb({"t": "event", "id": jid, "event": {
                "event": "error", "ok": False, "error": errors.reported(exc)[1]}})
        self.channel.send_bytes(data)

    send_event = _event   # (for jobs_api.begin_in_worker)

    REPLIED = {"t": "replied"}   # what a job's call returns when its answer was sent already

    def reply_done(self, jid, results: list) -> None:
        """A job's answer, its results encoded in parts that follow one another (any thread: the channel keeps
        messages whole): ``{"t": "done", "id", "ok": true, "value": <the parts as one bin>}``, written without
        joining the parts or copying them into the message."""
        size = sum(len(part) for part in results)
        head = wire.packb_with({"t": "done", "id": jid, "ok": True}, "value", wire.bin_header(size))
        message = [head, *results]
        last = jid in self.unanswered and len(self.unanswered) == 1   # (reply_now calls it on the batcher's thread)
        self.unanswered.discard(jid)
        if last and not self.end_told:
            # the batch's last answer: its end goes out with it, in the same write (every request of the batch is
            # answered, so nothing the server would blame on this batch is left; the server reads both at once)
            self.end_told = True
            self.channel.send_parts(message, then=BATCH_END)
        else:
            self.channel.send_parts(message)

    def _reply(self, reply) -> None:
        try:
            data = wire.packb(reply)
        except wire.WireError as exc:   # the result cannot be encoded: the request fails with 422, as in process
            data = wire.packb(self._failure(reply["id"], exc))
        except MemoryError:
            self._out_of_memory(reply["id"])
        self.channel.send_bytes(data)

    def _failure(self, jid, exc) -> dict:
        if is_out_of_memory(exc):
            self._out_of_memory(jid)
        status, error = errors.reported(exc)
        return {"t": "done", "id": jid, "ok": False, "status": status, "error": error}

    def _out_of_memory(self, jid) -> None:
        """A request ran out of memory: tell the server which, and exit (the supervisor re-runs the others)."""
        try:
            self.channel.send({"t": "oom", "id": jid})
        finally:
            os._exit(OOM_EXIT)


def _generated(jid, g) -> dict:
    return {"t": "done", "id": jid, "ok": True, "value": {
        "result": g.result, "tokens": g.tokens, "text": g.text,
        "emitted": [{"step": e["step"], "value": e["value"]} for e in g.emitted],
        **worker_results.generation_fields(g)}}     # logprobs, prompt_logprobs, cached_tokens


_ALLOC_FAILED = ("can't allocate memory", "Cannot allocate memory", "not enough memory")


def is_out_of_memory(exc, depth: int = 0) -> bool:
    """Whether ``exc`` (or an exception in its group or chain) is an allocation that failed."""
    if exc is None or depth > 8:
        return False
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, RuntimeError) and any(s in str(exc) for s in _ALLOC_FAILED):
        return True
    for sub in getattr(exc, "exceptions", None) or ():
        if is_out_of_memory(sub, depth + 1):
            return True
    return is_out_of_memory(exc.__cause__ or exc.__context__, depth + 1)
