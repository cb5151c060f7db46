"""Why a worker process is gone, and the error of the request that killed it.

Why this module exists: the pool that watches a worker (:mod:`.pool`) only
observes facts (a heartbeat that stood still, an exit status, a signal); the
request that caused them gets an exception saying what happened in words a
client can act on. Those exceptions are also what :mod:`.errors` maps to
HTTP statuses, so they live here, apart from the machinery that raises them.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

OOM_EXIT = 87          # a worker's exit status when a request ran out of memory (its rlimit)
FAILED_EXIT = 70       # a worker's exit status when the worker itself failed (logged)


class WorkerFailure(RuntimeError):
    """A request whose worker process hung, overran, crashed or ran out of memory while it ran alone.

    The server's answer for each subclass is in :data:`.errors.RULES`.
    """


class WorkerHung(WorkerFailure):
    """The worker made no progress (no heartbeat) while running the request alone."""


class WorkerOverran(WorkerFailure):
    """The worker ran the request alone past its batch's hard deadline."""


class WorkerCrashed(WorkerFailure):
    """The worker died (a signal, an unexpected exit, a broken pipe) while running the request alone."""


class WorkerOutOfMemory(WorkerFailure, MemoryError):
    """The worker exceeded its memory limit while running the request alone."""


class WorkerUnavailable(WorkerFailure):
    """No worker could be started for the request."""


class RemoteFailure(Exception):
    """A request that failed in the worker: its status and its error map as the worker reported them.

    ``wire_error`` is sent to the client as it is (:func:`~.wire.encode_error` uses it).
    """

    def __init__(self, status: int, error: dict):
        self.status = status
        self.kind = error.get("kind", "intervention")
        self.wire_error = error
        super().__init__(error.get("message", ""))


@dataclass
class Cause:
    """Why a worker is gone: ``kind`` (``hung``, ``overran``, ``crashed``, ``out_of_memory``, ``exited``,
    ``broken``, ``start``) and a sentence saying what happened."""

    kind: str
    detail: str


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def cause_of_exit(code, broken: str | None) -> Cause:
    """The cause of a worker's end from its exit code (``None``: still running, its pipe ``broken``)."""
    if code is None:
        return Cause("broken", f"broke the protocol ({broken})")
    if code < 0:
        name = _signal_name(-code)
        extra = " (the kernel's out-of-memory killer sends this when the machine runs out of memory)" \
            if -code == signal.SIGKILL else ""
        return Cause("crashed", f"crashed: killed by signal {-code} ({name}){extra}")
    if code == OOM_EXIT:
        return Cause("out_of_memory", "ran out of memory (its memory limit)")
    return Cause("exited", f"exited with status {code}")


def failure_for(cause: Cause, opts, rerun: bool) -> WorkerFailure:
    """The error of the request that killed a worker while it ran alone (``rerun``: in a re-run).

    ``opts``: the :class:`~.supervisor.ProcessIsolation` settings (its limits are quoted).
    """
    alone = ("alone (re-run by itself after a worker running its batch died)" if rerun else
             "alone in its batch")
    tail = "The server replaced that worker process with a new one; other requests were not affected."
    if cause.kind == "hung":
        return WorkerHung(
            f"the worker process made no progress for {opts.hang_timeout:g} s while running this request {alone}: "
            "code that holds the GIL in a C-level loop, such as any(iter(int, 1)), cannot be stopped inside the "
            f"process. {tail} Avoid such loops (Python-level loops are stopped at the compute budget).")
    if cause.kind == "overran":
        return WorkerOverran(
            f"the worker process running this request {alone} {cause.detail}. {tail} One long C call (a huge "
            "operation) or a blocking call cannot be interrupted at a hook point; make the work smaller.")
    if cause.kind == "out_of_memory":
        limit = f"{opts.memory_limit / 2**20:.0f} MiB above its size at start" if opts.memory_limit else "none"
        return WorkerOutOfMemory(
            f"out of memory: the worker process running this request {alone} exceeded its memory limit ({limit}). "
            f"{tail} Allocate less (Python lists and strings count too).")
    return WorkerCrashed(
        f"the worker process running this request {alone} {cause.detail}. {tail} If the request uses a registered "
        "intervention, this is a bug in server code or a library: report it with the request.")
