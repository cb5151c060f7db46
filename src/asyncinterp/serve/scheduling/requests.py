"""What a served request's code and its answer share with the front: ``emit``, the time meters, the results.

A served job is a :class:`~.submission.Submission`; inside the run that
serves it, the run's ``context`` maps each invoke to its
:class:`~.submission.ServedInvoke` (:data:`REQUESTS`), which is how
:func:`emit` inside an intervention finds where to send a value.
:class:`Meter` and :class:`Ledger` account for the time submitted code holds
the shared worker, so one request's deadline is not eaten by its
batch-mates'. :class:`GenerateResult` is what a generation answers;
:class:`BatcherFull` and :class:`BatcherClosed` are the front's refusals.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ...kernel.scheduler import current_kernel, current_task
from ...run import EVENTS


__all__ = ["BatcherClosed", "BatcherFull", "GenerateResult", "Ledger", "Meter", "REQUESTS", "emit"]


def __getattr__(name):   # old names: the compatibility table, asyncinterp.moved.RENAMED
    from ...moved import old_name
    return old_name(__name__, name)


class BatcherFull(RuntimeError):
    """The batcher's queue is full (the server answers 503)."""


class BatcherClosed(RuntimeError):
    """The batcher was closed before the request ran."""


@dataclass
class GenerateResult:
    """What a generation request returns: its intervention's result and what was generated for it."""

    result: object
    tokens: list            # generated ids (through the first end-of-sequence token)
    text: str
    emitted: list = field(default_factory=list)   # values the intervention emitted, in order
    cached_tokens: int | None = None   # prompt tokens the engine took from its prefix cache (vLLM; else None)
    logprobs: list | None = None       # with the logprobs option: per token, {token id: log-prob} (vLLM's order)
    prompt_logprobs: list | None = None   # with prompt_logprobs: per prompt token, None then {token id: log-prob}


# --------------------------------------------------------------------------- time accounting
class Ledger:
    """Seconds that metered interventions held a batcher's worker thread, in all (one per batcher).

    Written by the worker thread only (through :class:`Meter`); read by event loops to extend deadlines.
    """

    __slots__ = ("held", "start", "depth")

    def __init__(self):
        self.held = 0.0      # completed slices
        self.start = None    # perf_counter() when the slice now running began (None: none running)
        self.depth = 0

    def enter(self) -> None:
        if self.depth == 0:
            self.start = time.perf_counter()
        self.depth += 1

    def leave(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.held += time.perf_counter() - self.start   # add first, then clear: a reader may over-count
            self.start = None                               # for an instant, never under-count

    def total(self, now: float) -> float:
        held, start = self.held, self.start
        return held + (now - start if start is not None else 0.0)


class Meter:
    """The time one request's intervention holds the worker thread, and its deadline's credit.

    ``resume()``/``pause()`` bracket every resumption of the request's tasks
    (the sandbox's driver does this for submitted code; nested calls count
    once). ``wall`` and ``cpu`` are the seconds spent so far (``cpu``: this
    thread's CPU time). Attached to a batcher's :class:`Ledger`, ``credit()``
    is the time *other* requests' metered interventions held the worker
    since this request was queued: the batcher (and the sandbox's clock)
    add it to this request's deadline, so another request's runaway code
    does not use up this one's time limit. It is not capped (each piece of
    foreign code is bounded by its own budget, the queue by ``max_queue``,
    and a client that stops waiting disconnects, which cancels the
    request); ``max_credit`` can cap it.
    """

    __slots__ = ("wall", "cpu", "depth", "_w0", "_c0", "ledger", "held0", "max_credit")

    def __init__(self):
        self.wall = 0.0
        self.cpu = 0.0
        self.depth = 0
        self._w0 = 0.0
        self._c0 = 0.0
        self.ledger = None
        self.held0 = 0.0
        self.max_credit = None

    def attach(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.held0 = ledger.total(time.perf_counter())

    def resume(self) -> None:
        if self.depth == 0:
            if self.ledger is not None:
                self.ledger.enter()          # first: the ledger's slice contains this meter's
            self._w0 = time.perf_counter()
            self._c0 = time.thread_time()
        self.depth += 1

    def pause(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.wall += time.perf_counter() - self._w0
            self.cpu += time.thread_time() - self._c0
            if self.ledger is not None:
                self.ledger.leave()

    def cpu_now(self) -> float:
        """CPU seconds used so far, including the slice running now (call on the worker thread)."""
        return self.cpu + (time.thread_time() - self._c0 if self.depth else 0.0)

    def credit(self) -> float:
        """Seconds other requests' metered code held the worker since this request was queued (capped)."""
        ledger = self.ledger
        if ledger is None:
            return 0.0
        now = time.perf_counter()
        own = self.wall + (now - self._w0 if self.depth else 0.0)
        c = ledger.total(now) - self.held0 - own
        if self.max_credit is not None:
            c = min(c, self.max_credit)
        return max(c, 0.0)


REQUESTS = "serve.requests"   # run.context key: invoke index -> the ServedInvoke it runs


def emit(value) -> None:
    """Inside an intervention served by a :class:`~asyncinterp.serve.scheduling.batcher.Batcher`: send ``value`` to the client now.

    Streaming generation requests receive it as an ``emit`` event tagged with
    the current step; others collect it in ``GenerateResult.emitted``.
    Tensors are copied at once (activations change as the model goes on).
    Outside a served request this does nothing, so the same intervention
    runs locally unchanged.
    """
    kernel = current_kernel()
    task = current_task()
    if kernel is None or task is None:
        return None
    context = kernel.host.context
    requests = context.get(REQUESTS)
    if not requests:
        events = context.get(EVENTS)    # in a vLLM worker process: the engine loop carries it to the request
        if events is not None:
            events.append((task.group, {"event": "emit", "step": kernel.step, "value": _snapshot(value)}))
        return None
    req = requests.get(task.group)
    if req is None:
        return None
    value = _snapshot(value)
    item = {"event": "emit", "step": kernel.step, "value": value}
    req.emitted.append(item)
    if req.stream:
        req.event(item)
    return None


def _snapshot(value, depth=0):
    if depth > 32:
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        items = [_snapshot(v, depth + 1) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {k: _snapshot(v, depth + 1) for k, v in value.items()}
    return value
