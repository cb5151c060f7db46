"""One served request: its state, its mailbox, its result, and ``emit`` for values sent while it runs.

A :class:`Request` is what the :class:`~asyncinterp.serve.scheduling.batcher.Batcher`
queues, puts into a job (its invoke), and answers through: the worker thread
delivers the result or the error into the request's mailbox, which the
awaiting task reads in its own event loop. The job's ``context`` maps each
invoke to its request (:data:`REQUESTS`), which is how :func:`emit` inside
an intervention finds where to send a value. :class:`Meter` and
:class:`Ledger` account for the time submitted code holds the shared worker,
so one request's deadline is not eaten by its batch-mates'.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from ... import aio
from ...kernel.scheduler import current_kernel, current_task
from ...run import EVENTS

log = logging.getLogger("asyncinterp.serve")

__all__ = ["BatcherClosed", "BatcherFull", "GenerateResult", "Ledger", "Meter", "REQUESTS", "Request", "emit"]


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


# --------------------------------------------------------------------------- requests
_ids = itertools.count(1)


class Request:
    __slots__ = ("id", "kind", "input", "fns", "kwargs", "gen", "max_new_tokens", "key", "arrival", "state",
                 "invoke", "lock", "mailbox", "on_cancel", "tokens", "streamed", "emitted", "stream", "finished",
                 "meter")

    size = 1   # invokes this request puts into a batch (a Group of serve.groups: several)

    def __init__(self, kind, input, fns, kwargs, key, gen=None, max_new_tokens=None, on_cancel=None,
                 stream=False, meter=None):
        self.id = next(_ids)
        self.kind = kind
        self.input = input
        self.fns = list(fns)
        self.kwargs = kwargs
        self.gen = gen or {}
        self.max_new_tokens = max_new_tokens
        self.key = key
        self.arrival = time.monotonic()
        self.state = "queued"        # queued -> running -> done | cancelled
        self.invoke = None
        self.lock = threading.Lock()
        self.mailbox = aio.Mailbox()   # made in the requesting task's event loop
        self.on_cancel = on_cancel
        self.tokens = None           # generation: per row, the ids generated so far
        self.streamed = 0
        self.emitted = []
        self.stream = stream
        self.finished = False
        self.meter = meter if meter is not None else Meter()

    # worker side -------------------------------------------------------------
    def start(self) -> bool:
        with self.lock:
            if self.state != "queued":
                return False
            self.state = "running"
            return True

    def attach(self, invoke) -> None:
        with self.lock:
            self.invoke = invoke
            cancelled = self.state == "cancelled"
        if cancelled:
            invoke.cancel()

    def deliver(self, ok: bool, value) -> None:
        with self.lock:
            if self.state == "done" or self.finished:
                return
            self.finished = True
            if self.state == "cancelled":
                return
            self.state = "done"
        self.mailbox.put(("done", ok, value))

    def event(self, item) -> None:
        if self.state != "cancelled":
            self.mailbox.put(("event", True, item))

    def finish(self, model) -> None:
        """Deliver the result of this request's finished invoke (a value, or a generation's result)."""
        if self.kind == "generate":
            self.finish_generation(model.tokenizer)
            return
        try:
            value = self.invoke.result
        except BaseException as exc:  # noqa: BLE001
            self.deliver(False, exc)
        else:
            self.deliver(True, value)

    def finish_generation(self, tokenizer, early=False) -> None:
        """Deliver this generation request's result: its value, tokens and text (``early``: it left the run)."""
        if self.finished:
            return
        try:
            value = self.invoke.value() if early else self.invoke.result
        except BaseException as exc:  # noqa: BLE001
            self.deliver(False, exc)
            return
        rows = self.tokens or [[]]
        texts = [tokenizer.decode(row, skip_special_tokens=True) for row in rows]
        self.stream_tokens(tokenizer, final=True)
        single = len(rows) == 1
        lps = _logprobs(self.invoke, "logprobs") if self.gen.get("logprobs") is not None else None
        self.deliver(True, GenerateResult(value, rows[0] if single else rows, texts[0] if single else texts,
                                          list(self.emitted), getattr(self.invoke, "cached_tokens", None),
                                          None if lps is None else list(lps[:len(rows[0])]),
                                          _logprobs(self.invoke, "prompt_logprobs")
                                          if self.gen.get("prompt_logprobs") is not None else None))

    def stream_tokens(self, tokenizer, final=False) -> None:
        """A streaming request: send a ``token`` event for each token generated since the last call."""
        if not self.stream or self.tokens is None or len(self.tokens) != 1:
            return
        row = self.tokens[0]
        while self.streamed < len(row):
            i = self.streamed
            prev = tokenizer.decode(row[:i], skip_special_tokens=True)
            now = tokenizer.decode(row[:i + 1], skip_special_tokens=True)
            item = {"event": "token", "step": i, "token": row[i], "text": now[len(prev):]}
            if self.gen.get("logprobs") is not None:
                item["logprobs"] = _logprob_at(self.invoke, i)
                if i == 0 and self.gen.get("prompt_logprobs") is not None:
                    item["prompt_logprobs"] = _logprobs(self.invoke, "prompt_logprobs")
            self.event(item)
            self.streamed += 1

    # loop side ---------------------------------------------------------------
    def cancel(self) -> None:
        with self.lock:
            if self.state in ("done", "cancelled"):
                return
            self.state = "cancelled"
            inv = self.invoke
        if self.on_cancel is not None:
            try:
                self.on_cancel()
            except Exception:  # noqa: BLE001 - a callback must not break cancellation
                log.exception("on_cancel callback failed")
        if inv is not None:
            inv.cancel()


def _logprobs(invoke, name):
    """An invoke's ``logprobs``/``prompt_logprobs`` (both engines' invokes have them), or ``None``."""
    try:
        return getattr(invoke, name, None)
    except Exception:  # noqa: BLE001 - an invoke whose run has gone: nothing to report
        return None


def _logprob_at(invoke, i):
    at = getattr(invoke, "logprob_at", None)
    return None if at is None else at(i)


REQUESTS = "serve.requests"   # run.context key: invoke index -> the request it serves


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
