"""The supervisor: runs the model in worker processes, and kills and restarts a worker that hangs or dies.

Why: Python cannot stop, from inside, a C-level loop that holds the GIL, nor
survive a segfault or heap corruption. With ``Server(model,
isolation="process")`` the server keeps the HTTP side (API keys, body limits,
parameter checks, the sandbox's refusal of code, all before any model work)
and hands each accepted request to a worker process (:mod:`.worker_proc`)
that runs a normal :class:`~.batcher.Batcher` over the model. A
:class:`Supervisor` stands where the server's ``Batcher`` would: the same
``trace``/``generate``/``stream_generate``/``queue_size``/``stats`` surface.

Each *pool* has one worker: ``trusted`` for registered interventions and
plain generation, ``code`` for submitted code (with ``code_worker=True``,
the default), so a tenant's code never shares a forward, a process or a
CPU priority with the server owner's requests. A pool's thread watches its
worker every :data:`TICK` seconds and kills it (``SIGKILL``) when

* its heartbeat (:class:`~.channel.Heartbeat`) stood still for
  ``hang_timeout`` seconds: something holds the GIL (``hung``);
* the batch it runs is past its hard deadline: the batch's start + the
  longest ``timeout`` of its requests + the compute budgets of its
  submitted requests + ``hang_timeout`` (``overran``; catches long C calls
  that release the GIL, blocking calls and deadlocks, also after every
  request of the batch has had its answer);

and notices when it died: a signal (``crashed``), exit status
:data:`~.worker_proc.OOM_EXIT` (a request ran out of the worker's memory
limit, ``out_of_memory``), anything else (``exited``), a malformed message
(``broken``). Then it starts a new worker and sorts the requests the dead
one held: those of the batch that was running are *suspects* and are re-run
one at a time, each alone; a request that kills a worker while it runs alone
is the offender and fails with an error saying what happened (504 ``hung`` /
``overran``, 500 ``crashed``, 507 ``out_of_memory``). Every other request
(not started yet, or of a batch that had ended) is sent again as if new.
While suspects are re-run, the pool's other requests wait (in this
process: the queue and ``/v1/health`` keep answering).

Nothing the worker sends is unpickled: messages are msgpack (:mod:`.channel`).
Workers are never forked from the server process (whose other threads, Ray's
gRPC for one, would leave a fork their locks): they come from a fork server
and receive the model's shared weights and the registrations
(:mod:`.worker_start`).

This module holds the settings and the batcher-shaped :class:`Supervisor`;
a pool and its watch are in :mod:`.pool`, the causes of a worker's death and
the errors its offender gets in :mod:`.worker_failures` (their statuses in
:mod:`.errors`). Their names are importable from here too.
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
import time
from dataclasses import dataclass

from ... import aio
from ...moved import old_name
from ..scheduling.batcher import BatcherClosed, EventStream, GenerateResult
from . import worker_start
from ..scheduling.arrivals import Arrivals
from ..scheduling.arrivals import submitted as arrived
from ..scheduling.engine_front import front_for
# the pool and the failures are their own modules; their names stay importable from here
from .pool import TICK, Pool, WorkerHandle, reap  # noqa: F401
from ..scheduling.submission import NO_ENVELOPE, Envelope, Submission
from ..jobs.job_wire import served_job

from ..scheduling.worker_failures import (Cause, RemoteFailure, WorkerCrashed, WorkerFailure, WorkerHung,
        WorkerOutOfMemory, WorkerOverran, WorkerUnavailable, cause_of_exit, failure_for)

__all__ = ["Cause", "Pool", "ProcessIsolation", "RemoteFailure", "SupervisedStream", "Supervisor", "TICK",
           "WorkerCrashed", "WorkerEdit", "WorkerFailure", "WorkerHandle", "WorkerHung", "WorkerOutOfMemory",
           "WorkerOverran", "WorkerSpec", "WorkerUnavailable", "cause_of_exit", "check_forkable", "failure_for", "reap"]


def __getattr__(name):   # old names (Job: a submission): the compatibility table, asyncinterp.moved.RENAMED
    return old_name(__name__, name)


# --------------------------------------------------------------------------- settings
@dataclass
class ProcessIsolation:
    """Settings of ``Server(model, isolation=ProcessIsolation(...))`` (``isolation="process"``: the defaults).

    ``hang_timeout``: seconds without a heartbeat before a worker is killed
    (a legitimate worker beats every 10 ms; nothing legitimate holds the GIL
    that long). ``start_timeout``: seconds a new worker may take to be ready.
    ``memory_limit``: bytes a worker may grow beyond its size when started
    (``RLIMIT_DATA``; ``None``: no limit). ``code_worker``: submitted code
    runs in a worker of its own (else in the one worker). ``code_nice``: the
    CPU niceness added to that worker, so that the server and registered
    requests come first. ``max_failed_starts``: workers that fail to start
    in a row before the pool fails its waiting requests (503). ``confine``:
    the worker that runs submitted code is confined by seccomp
    (:mod:`.confine`: no exec, no new process, no new socket, no file writes);
    ``"auto"``: where the platform can (the server says at start whether it
    does), ``True``: the server refuses to start where it cannot, ``False``: off.
    """

    hang_timeout: float = 5.0
    start_timeout: float = 60.0
    memory_limit: int | None = 4 << 30
    code_worker: bool = True
    code_nice: int = 10
    max_failed_starts: int = 3
    confine: bool | str = "auto"

    def __post_init__(self):
        if not self.hang_timeout > 0 or not self.start_timeout > 0:
            raise ValueError("hang_timeout and start_timeout must be positive numbers of seconds")
        if self.memory_limit is not None and self.memory_limit < (64 << 20):
            raise ValueError(f"memory_limit must be at least 64 MiB (or None), got {self.memory_limit!r}")


def check_forkable(model) -> None:
    """Raise ``ValueError`` if ``model`` cannot be served from a worker process (one that maps the server's
    weights from shared memory, :mod:`.worker_start`)."""
    if not hasattr(os, "fork"):
        raise ValueError("process isolation needs os.fork (Linux, macOS); use isolation='thread'")
    refusal = front_for(model).fork_refusal()
    if refusal is not None:
        raise ValueError(refusal)
    module = getattr(model, "module", None)
    params = module.parameters() if hasattr(module, "parameters") else ()
    for p in itertools.islice(params, 1000):
        if p.device.type != "cpu":
            raise ValueError(f"process isolation shares the model's CPU memory with its worker processes, and "
                             f"the model has parameters on {p.device.type}; use isolation='thread'")


# --------------------------------------------------------------------------- what runs in the worker
class WorkerSpec:
    """An intervention as the worker binds it: ``{"name", "params"}`` or ``{"source", "entry", "params"}``."""

    __slots__ = ("spec", "submitted")

    def __init__(self, spec):
        if isinstance(spec, str):
            spec = {"name": spec}
        self.spec = dict(spec)
        self.submitted = "source" in self.spec

    def __repr__(self):
        what = f"submitted:{self.spec.get('entry') or '?'}" if self.submitted else self.spec.get("name")
        return f"<WorkerSpec {what}>"


class WorkerEdit:
    """A named edit (:mod:`.model_names`) as it travels to a worker: by its name. The worker runs its own copy
    of the edit (sent with the server's installed edits when it starts; a worker started before an edit was
    installed is replaced when idle, as for interventions registered after its start)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"<WorkerEdit {self.name}>"


# --------------------------------------------------------------------------- the batcher-shaped front
class Supervisor(aio.Closable):
    """Stands where the server's :class:`~.batcher.Batcher` would; the model runs in worker processes.

    ``server``: the :class:`~.app.Server` (its model, registered interventions
    and limits; the workers receive them when they start and bind
    interventions with ``server.bind_intervention``). ``isolation``:
    ``"process"`` or a :class:`ProcessIsolation`. The batching options are the
    workers' :class:`Batcher`'s.
    """

    def __init__(self, server, isolation="process", *, max_batch: int = 32, max_wait_ms: float = 5.0,
                 max_queue: int = 256, exact: bool = False, name: str = "serve"):
        self.options = isolation if isinstance(isolation, ProcessIsolation) else ProcessIsolation()
        check_forkable(server.model)
        worker_start.share_model(server.model)   # the weights in shared memory once: workers map them, never copy
        self.server = server
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.batcher_options = {"max_batch": max_batch, "max_wait_ms": max_wait_ms, "exact": exact,
                                "max_queue": 1 << 20}
        self.name = name
        self.counts = collections.Counter()
        self.counts_lock = threading.Lock()
        self.pools = {"trusted": Pool(self, "trusted", 0)}
        if self.options.code_worker:
            self.pools["code"] = Pool(self, "code", self.options.code_nice)
        self.loop = None            # the server's event loop (what workers are sent is read there, in_server_loop)
        self.closed = False
        # requests on their way (received, not yet submitted): told to the workers, whose batches wait only for them
        self._relayed_some = False
        self.arrivals = Arrivals(threading.Condition(), self._relay_arrivals)

    def _relay_arrivals(self, count: int) -> None:
        # a worker's batch waits while anything is on its way: only the turns between none and some matter
        some = count > 0
        with self.counts_lock:
            if some == self._relayed_some:
                return
            self._relayed_some = some
        for pool in self.pools.values():
            pool.relay_arrivals(count)

    @property
    def stats(self) -> dict:
        """Counts: ``batches``, ``requests``, ``restarts``, ``reruns``, ``blamed``, and one per cause of death
        (``hung``, ``overran``, ``crashed``, ``out_of_memory``, ``exited``, ``broken``, ``start``)."""
        with self.counts_lock:
            out = {"batches": 0, "requests": 0, "restarts": 0, "reruns": 0, "blamed": 0}
            out.update(self.counts)
        return out

    def count(self, key: str, n=1) -> None:
        with self.counts_lock:
            self.counts[key] += n

    def in_server_loop(self, fn, timeout: float = 10.0):
        """``fn()`` run in the server's event-loop thread, between its callbacks; returns its result.

        What a starting worker is sent is read there (:func:`~.worker_start.snapshot`):
        registering interventions and installing edits happen in that thread,
        so the snapshot is whole. Before the first request (no loop yet),
        ``fn()`` runs in the calling thread.
        """
        loop = self.loop
        if loop is None:
            return fn()
        lock = threading.Lock()
        done = threading.Event()
        box = {"state": "queued"}

        def call():
            with lock:
                if box["state"] != "queued":
                    return
                box["state"] = "running"
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                box["exc"] = exc
            finally:
                done.set()

        loop.call_soon(call)
        if not done.wait(timeout):
            with lock:
                if box["state"] == "queued":
                    box["state"] = "abandoned"
                    raise RuntimeError(f"the server's event loop did not start the worker within {timeout:g} s")
            done.wait()
        if "exc" in box:
            raise box["exc"]
        return box["value"]

    # ------------------------------------------------------------------ what the server calls
    def remote(self, spec) -> WorkerSpec:
        """The intervention ``spec`` (already checked by the server) as it travels to a worker."""
        ws = WorkerSpec(spec)
        if not ws.submitted:
            pool = self.pools["trusted"]
            with pool.cond:
                if pool.forked_names is not None and ws.spec.get("name") not in pool.forked_names:
                    pool.stale = True       # registered after its start: replace the worker when it is idle
        return ws

    def remote_edits(self, edits) -> tuple:
        """The installed edits ``edits`` (a :class:`~.model_names.Selection`'s, in order) as they travel to a
        worker, to be passed before the request's own :meth:`remote` intervention."""
        return tuple(WorkerEdit(e.name) for e in edits)

    def start(self, timeout: float | None = None) -> None:
        """Start the worker processes now (instead of at the first request) and wait until they are ready."""
        pools = [p for n, p in self.pools.items() if n == "trusted" or self.server.allow_code]
        for p in pools:
            p.want_worker()
        deadline = time.monotonic() + (timeout or self.options.start_timeout)
        for p in pools:
            while not (p.worker is not None and p.worker.ready):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the {p.name} worker process did not start within "
                                       f"{timeout or self.options.start_timeout:g} s")
                time.sleep(0.01)

    async def trace(self, input, *fns, timeout: float | None = None, on_cancel=None, meter=None, owner=None,
                    receipt=None, **kwargs):
        if kwargs:
            raise TypeError(f"a supervised server takes no invoke options ({sorted(kwargs)})")
        job = self._submit("trace", input, fns, timeout, {}, envelope=Envelope(owner, None, timeout, receipt))
        return await self._wait(job)

    async def generate(self, input, *fns, max_new_tokens: int = 20, timeout: float | None = None,
                       on_cancel=None, meter=None, owner=None, receipt=None, **generate_kwargs) -> GenerateResult:
        job = self._submit("generate", input, fns, timeout, {"max_new_tokens": max_new_tokens,
                                                               "gen": generate_kwargs, "stream": False},
                           envelope=Envelope(owner, None, timeout, receipt))
        return await self._wait(job)

    def stream_generate(self, input, *fns, max_new_tokens: int = 20, timeout: float | None = None,
                        on_cancel=None, meter=None, owner=None, receipt=None,
                        **generate_kwargs) -> "SupervisedStream":
        job = self._submit("generate", input, fns, timeout, {"max_new_tokens": max_new_tokens,
                                                               "gen": generate_kwargs, "stream": True},
                           envelope=Envelope(owner, None, timeout, receipt))
        return SupervisedStream(job)

    async def job(self, data: bytes, *, code: bool, timeout: float | None = None, owner=None):
        """A remote job (``POST /v1/jobs``) as the client wrote it: the worker reads, checks and runs it whole
        (:func:`~..jobs.jobs_api.begin_in_worker`); returns its answer's ``results`` (one entry per invoke) as the
        msgpack bytes the worker encoded (passed on to the client as they are, never decoded and encoded again).
        ``code``: it carries captured functions (the code pool runs it, see :func:`~..jobs.job_wire.outline_job`)."""
        return await self._wait(self._submit_job(data, code, timeout, False, owner))

    def stream_job(self, data: bytes, *, code: bool, timeout: float | None = None, owner=None) -> "SupervisedStream":
        """:meth:`job` as a stream: ``accepted`` once the worker has read and checked it and its batch begins (the
        worker's ``batch`` message), its invokes' events, then ``done`` with the results."""
        return SupervisedStream(self._submit_job(data, code, timeout, True, owner))

    def _submit_job(self, data, code, timeout, stream, owner=None) -> Submission:
        if self.closed:
            raise BatcherClosed("the server is shutting down")
        if self.loop is None:
            self.loop = aio.LoopHandle()
        timeout = float(self.server.timeout if timeout is None else timeout)
        pool = self.pools["code" if code and "code" in self.pools else "trusted"]
        guard = 3 * timeout + 4 * self.options.hang_timeout + 60.0
        # (its owner: the worker keeps the ids of its prompts for it alone, see jobs.prompt_ids)
        sub = Submission.for_worker("job", {"job": data, "stream": stream, "owner": owner}, timeout=timeout,
                                    code_budget=min(self.server.code_budget, timeout) if code else 0.0, guard=guard,
                                    stream=stream, envelope=Envelope(owner, None, timeout))
        arrived()   # before it is sent: in the worker it is on its way until submitted there (Worker._arriving)
        pool.submit(sub)
        return sub

    async def session(self, body: dict, timeout: float | None = None):
        """Run a session (:mod:`.sessions`) in the worker that runs submitted code; returns its result."""
        job = self._submit("session", None, (), timeout, {"session": body}, submitted=True)
        return await self._wait(job)

    def queue_size(self) -> int:
        return sum(p.queue_size() for p in self.pools.values())

    def health(self) -> dict:
        return {"isolation": "process", "workers": {n: p.describe() for n, p in self.pools.items()}}

    def restart_times(self) -> list:
        """Seconds from each worker's death to its successor being ready (the last 50 per pool)."""
        return [t for p in self.pools.values() for t in p.restart_times]

    def close(self, timeout: float = 10.0) -> None:
        self.closed = True
        for p in self.pools.values():
            p.close(timeout)

    # ------------------------------------------------------------------ internals
    def _submit(self, kind, input, fns, timeout, fields, submitted=None, envelope=NO_ENVELOPE) -> Submission:
        if self.closed:
            raise BatcherClosed("the server is shutting down")
        if self.loop is None:
            self.loop = aio.LoopHandle()
        edits = [f.name for f in fns if isinstance(f, WorkerEdit)]
        rest = fns[len(edits):]
        spec = rest[0] if rest else None
        if len(rest) > 1 or (spec is not None and not isinstance(spec, WorkerSpec)):
            raise TypeError("a supervised server runs a request's named edits (Supervisor.remote_edits, first) and "
                            "one intervention, described by Supervisor.remote(spec) (functions of this process "
                            "cannot run in a worker)")
        timeout = float(self.server.timeout if timeout is None else timeout)
        if submitted is None:
            submitted = spec is not None and spec.submitted
        budget = min(self.server.code_budget, timeout) if submitted else 0.0
        pool = self.pools["code" if submitted and "code" in self.pools else "trusted"]
        # the server waits at most this long in all (worker restarts and re-runs included); the worker's own
        # limits and the hard deadlines end every request well before
        guard = 3 * timeout + 4 * self.options.hang_timeout + 60.0
        if edits:
            pool.edits_installed(edits)
        if kind != "session":   # the request as a job in the wire form: what the worker reads (job_wire.read_job)
            generation = dict(fields["gen"], max_new_tokens=fields["max_new_tokens"]) if kind == "generate" else {}
            specs = [{"edit": name} for name in edits] + ([spec.spec] if spec is not None else [])
            fields = {"job": served_job(kind, input, specs, generation), "stream": fields.get("stream", False)}
        job = Submission.for_worker(kind, fields, timeout=timeout, code_budget=budget, guard=guard,
                                    stream=bool(fields.get("stream")), envelope=envelope)
        arrived()
        pool.submit(job)
        return job

    async def _wait(self, job: Submission):
        try:
            while True:
                kind, ok, value = await _next(job)
                if kind == "done":
                    break
        except BaseException:
            job.pool.cancel(job)
            raise
        if not ok:
            raise value
        return value


async def _next(job: Submission):
    with aio.fail_at(job.guard):
        return await job.mailbox.get()


class SupervisedStream(EventStream):
    """Async iterator over a streaming generation's events, as :class:`~.batcher.GenerationStream`."""

    def __init__(self, job: Submission):
        self.job = job

    def _next(self):
        return _next(self.job)

    def _cancel(self) -> None:
        self.job.pool.cancel(self.job)
