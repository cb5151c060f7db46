"""Dynamic batching: concurrent requests, each with its own intervention, share forward passes.

    batcher = ai.serve.Batcher(model, max_batch=32, max_wait_ms=5)

    async def handler(prompt, strength):
        return await batcher.trace(prompt, functools.partial(steer, strength=strength))

A request that reaches an idle engine starts at once; requests that arrive
while a forward runs join the next one (up to ``max_batch`` of them), as
continuous batching does. A batch waits for company (at most ``max_wait_ms``
after its first request) only while other requests are known to be on their
way: received by the server but not yet submitted (:mod:`.arrivals`). The
requests of one batch become the invokes of one run with
``on_error="continue"``: each request's intervention sees only its own rows,
and its failure fails only its own request. A dedicated worker thread runs
the batches one after another, so the event loop (asyncio or trio, any
number of them) stays free and the model runs one batch at a time.

Cancellation and timeouts are per request: a request cancelled while queued
never runs; one cancelled while its batch runs has its intervention closed
at the next hook point (``Invoke.cancel``) while the forward and the other
requests go on; submitted code in a runaway Python loop is stopped by the
sandbox's tick.

Generation requests (``await batcher.generate(prompt, fn, max_new_tokens=n)``
on a :class:`~asyncinterp.LanguageModel`) are coalesced the same way into one
``generate`` call. Each request leaves the batch when it has its own
``max_new_tokens`` tokens or produced an end-of-sequence token: its step loop
ends there (``Kernel.end_group``), exactly as if it had run alone, and its
result is delivered at once, before the longer requests finish.

On a vLLM engine (:class:`~asyncinterp.VLLM`, a model with ``submit``) there
is no batching here at all: the engine batches continuously. Each request
becomes its own run that joins the running engine between two steps
(:mod:`asyncinterp.models.vllm.loop`), streams its tokens and emitted values
as each step produces them, and gets its result the moment its own request
finishes.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time

import torch

from ... import aio
from ...kernel.errors import RunCancelled
from ...job import Trace
from ...kernel.scheduler import current_run
from ...models.generating import SEEDS, check_stop, eos_ids, stop_hit
from .arrivals import Arrivals, submitted
from .requests import REQUESTS, BatcherClosed, BatcherFull, GenerateResult, Ledger, Meter, emit  # noqa: F401
from .submission import NO_ENVELOPE, Envelope, Submission

log = logging.getLogger("asyncinterp.serve")


def is_live_engine(model) -> bool:
    """True for an engine that batches requests by itself and takes them while it runs (``ai.VLLM``:
    it has ``submit``); the Batcher hands such a model each request at once instead of coalescing."""
    return callable(getattr(model, "submit", None))


def _shape_key(x):
    """Which inputs can share a forward of a plain wrapped model: same trailing shapes and dtypes."""
    if isinstance(x, torch.Tensor):
        return ("t", tuple(x.shape[1:]), x.dtype, x.device)
    if isinstance(x, tuple):
        return ("tuple",) + tuple(_shape_key(v) for v in x)
    if isinstance(x, dict):
        return ("dict",) + tuple(sorted((k, _shape_key(v)) for k, v in x.items()))
    if isinstance(x, list) and x and all(isinstance(v, torch.Tensor) for v in x):
        return ("list",) + tuple(_shape_key(v) for v in x)
    try:
        hash(x)
        return ("v", x)
    except TypeError:
        return ("id", id(x))


def _own_seed(gen: dict) -> dict:
    """A generation request's options with a seed of its own: its samples then come from its own generator
    (vLLM's per-request generators; :mod:`asyncinterp.models.hf.sampling`), never from one that its
    batch-mates or their interventions draw from. A request without a seed gets a fresh random one."""
    if gen.get("seed") is not None:
        return gen
    return {**gen, "seed": secrets.randbits(62)}


def _generation_key(gen: dict) -> tuple:
    """Which generation requests can share a generate call: equal options, the seed aside (it is per request)."""
    return tuple(sorted((k, _freeze(v)) for k, v in gen.items() if k != "seed"))


def _freeze(obj):
    try:
        hash(obj)
        return obj
    except TypeError:
        return repr(obj)


# --------------------------------------------------------------------------- the batcher
class Batcher(aio.Closable):
    """Coalesce concurrent ``trace``/``generate`` requests into shared runs of ``model``.

    ``max_batch``: most requests in one run. ``max_wait_ms``: the most a
    batch waits for requests that are on their way (``arrivals``: counted
    by the server between a request's arrival and its submission); with
    nothing on its way a batch starts at once (0: never wait). ``max_queue``: waiting requests beyond this
    raise :class:`BatcherFull`. ``timeout``: default per-request limit in
    seconds (``None``: none). ``exact``: only coalesce language-model prompts
    of equal token length (no padding), for results bit-equal to solo runs
    on kernels whose numerics depend on the padded length. ``no_grad``: run
    forwards without autograd (default). ``key``: a function of a request's
    input returning a hashable; only requests with equal keys share a run
    (default: everything for language models, equal trailing shapes for
    plain wrapped models).
    """

    def __init__(self, model, max_batch: int = 32, max_wait_ms: float = 5.0, *, max_queue: int = 1024,
                 timeout: float | None = None, exact: bool = False, no_grad: bool = True, key=None,
                 name: str = "batcher"):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive int, got {max_batch!r}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms!r}")
        self.model = model
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000.0
        self.max_queue = max_queue
        self.timeout = timeout
        self.exact = exact
        self.no_grad = no_grad
        self._key_fn = key
        self.name = name
        self._pending = collections.deque()
        self._cond = threading.Condition()
        self.arrivals = Arrivals(self._cond)   # requests on their way: the only reason a batch waits
        self._closed = False
        self._thread = None
        self._current = None
        self.ledger = Ledger()
        self.stats = {"batches": 0, "requests": 0, "max_batch_seen": 0, "fallbacks": 0, "cancelled": 0}
        self._is_lm = hasattr(model, "tokenizer") and hasattr(model, "generate")
        self._live = is_live_engine(model)
        self._running = set()            # live mode: the runs in the engine

    # ------------------------------------------------------------------ as an engine
    def make_invoke(self, index: int, input, fns: tuple, kwargs: dict, deferred: bool, kind: str = "trace"):
        """Check one invoke of a job for this front (the model's own engine does: a bad input or intervention
        fails here, on the caller's line); returns its result carrier, whose ``spec`` is the job's part."""
        return self.model.engine(kind).make_invoke(index, input, fns, kwargs, deferred)

    def start(self, job, envelope: Envelope = NO_ENVELOPE, *, stream: bool = False, single: bool = False,
              on_answer=None) -> Submission:
        """Take a job (a :class:`~asyncinterp.job.Job`, or the parts a server read: anything with its
        ``invokes``, ``kind``, ``on_error`` and ``generation``) with its serving envelope; queue it (a live
        engine: hand it to the engine now) and return its :class:`~.submission.Submission`, whose answer
        :meth:`answer` awaits. ``single``: its answer is its one invoke's value, not one ``(ok, value)`` per
        invoke; ``on_answer(ok, value)``: called in the thread that answers it, first (see
        :meth:`~.submission.Submission.answer`)."""
        if any(spec.background for spec in job.invokes):
            raise ValueError("a job with persistent edits (model.edit) cannot go through the serving front: the "
                             "front runs its model's own edits; send the job's other invokes")
        if job.context:
            raise ValueError(f"a job's context ({sorted(map(str, job.context))}) does not reach a served run: "
                             "pass what the interventions need as their arguments")
        generation = dict(job.generation or {})
        max_new_tokens = generation.pop("max_new_tokens", None)
        return self._submission(job.kind, job.invokes, job.on_error, generation, max_new_tokens, stream, single,
                                envelope, on_answer)

    async def answer(self, sub: Submission):
        """Wait for ``sub``'s answer (``TimeoutError`` at its envelope's deadline, extended by the time other
        requests' metered code held the worker: :class:`Meter`); leaving early cancels it."""
        return await self._wait(sub)

    def events(self, sub: Submission) -> "GenerationStream":
        """``sub``'s events as an async iterator (a streaming submission: tokens, emitted values, tagged
        ``"invoke": i`` when it has several invokes), then ``{"event": "done", "result": ...}``."""
        return GenerationStream(self, sub, self._deadline(sub.envelope.deadline))

    # ------------------------------------------------------------------ public
    async def trace(self, input, *fns, timeout: float | None = None, on_cancel=None, meter=None, owner=None,
                    receipt=None, **kwargs):
        """Run ``fns`` on ``input`` in a shared forward; returns what ``model.trace(input, *fns)`` returns.

        ``timeout`` (seconds) bounds this request only (``TimeoutError``),
        extended by the time other requests' metered interventions held the
        worker meanwhile (:class:`Meter`; at most by ``timeout`` again);
        ``on_cancel`` is called (in this event loop) if the request is
        cancelled or times out; ``meter``: the :class:`Meter` that this
        request's intervention reports its time to (submitted code's clock);
        ``owner`` and ``receipt``: the rest of its :class:`~.submission.Envelope`; ``kwargs`` go to the invoke.
        """
        sub = self._submission("trace", ((input, fns, kwargs),), "stop", None, None, False, True,
                               Envelope(owner, meter, timeout, receipt, on_cancel))
        return await self._wait(sub)

    async def generate(self, input, *fns, max_new_tokens: int = 20, timeout: float | None = None,
                       on_cancel=None, meter=None, owner=None, receipt=None, **generate_kwargs) -> GenerateResult:
        """Generate for ``input`` with ``fns`` in a shared generation; returns a :class:`GenerateResult`."""
        sub = self._single_generation(input, fns, max_new_tokens, generate_kwargs, False,
                                      Envelope(owner, meter, timeout, receipt, on_cancel))
        return await self._wait(sub)

    def stream_generate(self, input, *fns, max_new_tokens: int = 20, timeout: float | None = None,
                        on_cancel=None, meter=None, owner=None, receipt=None,
                        **generate_kwargs) -> "GenerationStream":
        """Like :meth:`generate`, as an async iterator of events while the generation runs.

        The request is queued at once (so :class:`BatcherFull` is raised
        here). Events are dicts: ``{"event": "token", "step", "token",
        "text"}`` for each generated token, ``{"event": "emit", "step",
        "value"}`` for each :func:`emit` of the intervention, and last
        ``{"event": "done", "result": GenerateResult}``. Errors are raised
        from the iterator; leaving the loop early (or ``aclose()``) cancels
        the request.
        """
        sub = self._single_generation(input, fns, max_new_tokens, generate_kwargs, True,
                                      Envelope(owner, meter, timeout, receipt, on_cancel))
        return self.events(sub)

    def queue_size(self) -> int:
        return len(self._pending) + len(self._running)

    def close(self, timeout: float = 10.0) -> None:
        """Stop accepting requests; fail the queued ones; stop the running batch; join the worker."""
        with self._cond:
            self._closed = True
            pending = list(self._pending)
            self._pending.clear()
            self._cond.notify_all()
        for sub in pending:
            sub.answer(False, BatcherClosed("the batcher was closed before this request ran"))
        run = self._current
        if run is not None:
            run.cancel()
        for run in list(self._running):
            run.cancel()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    # ------------------------------------------------------------------ submitting
    def _single_generation(self, input, fns, max_new_tokens, generate_kwargs, stream, envelope):
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        return self._submission("generate", ((input, fns, {}),), "stop", generate_kwargs, max_new_tokens, stream,
                                True, envelope)

    def _submission(self, kind, invokes, on_error, gen, max_new_tokens, stream, single, envelope,
                    on_answer=None) -> Submission:
        """The one submission of a job (``invokes``: its invoke specs, or ``(input, fns[, kwargs])``): checked,
        keyed (which submissions may share a run) and queued."""
        if not invokes or len(invokes) > self.max_batch:
            raise ValueError(f"a job has 1 to max_batch={self.max_batch} invokes, got {len(invokes)}")
        if self._live and len(invokes) > 1:
            raise TypeError("a job of several invokes in one forward is not available on a live engine (vLLM) yet")
        for spec in invokes:
            for fn in spec[1]:
                if not callable(fn):
                    raise TypeError(f"an intervention must be an async function taking the model envoy, got {fn!r}")
        first = invokes[0]
        if kind == "generate":
            if not self._is_lm:
                raise TypeError("generation requests need a LanguageModel (with a tokenizer and generate)")
            gen = gen or {}
            key = ("generate", self._input_key(first[0]), _generation_key(gen))
        else:
            kwargs = first[2] if len(first) > 2 and first[2] else {}   # (the invokes of a job agree on them)
            grad = any(getattr(fn, "needs_grad", False) for spec in invokes for fn in spec[1])
            key = ("trace", self._input_key(first[0]), tuple(sorted((k, _freeze(v)) for k, v in kwargs.items())),
                   grad)   # gradient requests share runs only together
        if any(spec[0] is None for spec in invokes):
            # an invoke without input sees "the whole batch": the job runs in a batch of its own, so that batch
            # holds this job's rows only, never another request's
            key += (object(),)
        sub = Submission(kind, invokes, on_error=on_error, gen=gen, max_new_tokens=max_new_tokens, key=key,
                         single=single, stream=stream, envelope=envelope)
        sub.on_answer = on_answer
        if kind == "generate":
            for inv in sub.invokes:   # as locally: the job's seed for every invoke, or a fresh one for each
                inv.gen = _own_seed(inv.gen)
        sub.meter.attach(self.ledger)
        self._submit(sub)
        return sub

    def _input_key(self, input):
        if self._key_fn is not None:
            return self._key_fn(input)
        if self._is_lm:
            if not self.exact:
                return None
            try:
                from ...models.hf.inputs import to_prompt
                p = to_prompt(input, self.model.tokenizer)
                return tuple(len(r) for r in p.rows)
            except Exception:  # invalid input: fails on its own at invoke time
                return ("invalid", id(input))
        return _shape_key(input)

    def _submit(self, sub):
        submitted()
        if self._live:
            return self._start_live(sub)
        with self._cond:
            if self._closed:
                raise BatcherClosed("the batcher is closed")
            if len(self._pending) >= self.max_queue:
                raise BatcherFull(f"{len(self._pending)} requests are waiting (max_queue={self.max_queue}); "
                                  "try again later")
            self._pending.append(sub)
            if self._thread is None:
                self._thread = threading.Thread(target=self._worker, name=f"asyncinterp-{self.name}", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _deadline(self, timeout):
        timeout = self.timeout if timeout is None else timeout
        return None if timeout is None else time.monotonic() + timeout

    async def _wait(self, sub):
        deadline = self._deadline(sub.envelope.deadline)
        try:
            while True:
                kind, ok, value = await _next_item(sub, deadline)
                if kind == "done":
                    break
        except BaseException:
            sub.cancel()
            self.unqueue(sub)
            self.stats["cancelled"] += 1
            raise
        if not ok:
            raise value
        return value

    def unqueue(self, sub) -> None:
        """Take a (cancelled) submission out of the queue, if it is still there."""
        with self._cond:
            try:
                self._pending.remove(sub)
            except ValueError:
                pass

    # ------------------------------------------------------------------ live engines (vLLM)
    def _start_live(self, sub):
        """Hand ``sub`` to the engine now as a run of its own (it joins before the next engine step)."""
        model = self.model
        with self._cond:
            if self._closed:
                raise BatcherClosed("the batcher is closed")
            if len(self._running) >= self.max_queue + self.max_batch:
                raise BatcherFull(f"{len(self._running)} requests are in the engine (max_queue + max_batch = "
                                  f"{self.max_queue + self.max_batch}); try again later")
        sub.start()
        served = sub.invokes[0]
        try:
            # the job is built once, with everything up front: m.stop() ends this request only, the request
            # table for serve.emit and the listener that hears its tokens are part of it when it is frozen
            # the request's sampling options are its invoke's own: the engine makes its sampling parameters and
            # adapter request once, when the invoke is made
            trace = Trace(model, sub.kind, "continue", stop_per_invoke=True)
            trace.listener = _LiveListener(self, served)
            options = dict(served.kwargs, **served.gen, max_new_tokens=sub.max_new_tokens) \
                if sub.kind == "generate" else served.kwargs
            inv = trace.invoke(served.input, *served.fns, **options)
            trace.context[REQUESTS] = {inv.index: served}
            served.tokens = [inv.token_ids]      # the engine appends to it step by step
            run = trace.start()                  # the job, frozen (nothing runs until it is submitted)
        except Exception as exc:  # noqa: BLE001 - this request's input or intervention is invalid
            served.deliver(False, exc)
            return
        with self._cond:
            self._running.add(run)
            running = len(self._running)
        self.stats["requests"] += 1
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], running)   # most runs in the engine at once
        served.attach(inv)
        try:
            model.submit(trace)
        except Exception as exc:  # noqa: BLE001 - e.g. the engine was closed
            with self._cond:
                self._running.discard(run)
            served.deliver(False, exc)

    def finish_live(self, served, run) -> None:
        """A live run ended (engine loop thread): deliver its invoke's result or error."""
        with self._cond:
            self._running.discard(run)
        if run.error is not None:
            err = run.error
            if isinstance(err, RunCancelled) or self._closed:
                err = BatcherClosed("the batcher was closed while this request ran")
            served.deliver(False, err)
        else:
            served.finish(self.model)

    # ------------------------------------------------------------------ worker
    def _worker(self):
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                self._execute(batch)
            except BaseException as exc:  # noqa: BLE001 - never let the worker die
                log.exception("batcher worker error")
                for sub in batch:
                    sub.answer(False, exc)

    def _next_batch(self):
        cond = self._cond
        with cond:
            while True:
                while self._pending and self._pending[0].state != "queued":
                    self._pending.popleft()
                if self._pending:
                    break
                if self._closed:
                    return None
                cond.wait()
            first = self._pending[0]
            deadline = first.arrival + self.max_wait
            while self.arrivals.total > 0:   # wait only for company that is on its way
                n = sum(r.size for r in self._pending if r.key == first.key and r.state == "queued")
                now = time.monotonic()
                if n >= self.max_batch or now >= deadline or self._closed:
                    break
                cond.wait(deadline - now)
            batch = []
            keep = collections.deque()
            size = 0   # invokes in the batch (a submission is never split: it goes in whole or waits)
            for r in self._pending:
                if r.state != "queued":
                    continue
                if size + r.size <= self.max_batch and r.key == first.key:
                    batch.append(r)
                    size += r.size
                else:
                    keep.append(r)
            self._pending = keep
            return batch

    def _execute(self, batch):
        live = [r for r in batch if r.start()]
        if not live:
            return
        self.stats["batches"] += 1
        self.stats["requests"] += len(live)
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], len(live))
        t0 = time.perf_counter()
        try:
            self._run(live)
        except BaseException as exc:  # noqa: BLE001 - the run itself failed (bad input, the model raised)
            if isinstance(exc, RunCancelled) or self._closed:
                for sub in live:
                    sub.answer(False, BatcherClosed("the batcher was closed while this request ran"))
                return
            if len(live) == 1:
                live[0].answer(False, exc)
                return
            # isolate the request that broke the shared run: rerun each alone
            self.stats["fallbacks"] += 1
            log.info("batch of %d failed (%s: %s); rerunning its requests one by one", len(live),
                     type(exc).__name__, exc)
            for sub in live:
                if sub.state != "running":
                    continue
                sub.reset()
                try:
                    self._run([sub])
                except BaseException as solo_exc:  # noqa: BLE001
                    sub.answer(False, solo_exc)
        log.debug("batch of %d ran in %.1f ms", len(live), 1000 * (time.perf_counter() - t0))

    def _run(self, live):
        model = self.model
        generating = live[0].kind == "generate"
        # m.stop() from one request ends that request only (its unfinished tasks are closed at the next hook
        # point, as a stopped run would leave them); the shared forward goes on for the others
        if generating:
            n_max = max(r.max_new_tokens for r in live)
            shared = {k: v for k, v in live[0].gen.items() if k != "seed"}   # (seeds are per request: SEEDS)
            tr = Trace(model, "generate", "continue", stop_per_invoke=True,
                        generation=dict(shared, max_new_tokens=n_max))
            seeds = tr.context[SEEDS] = {}
        else:
            tr = Trace(model, "trace", "continue", stop_per_invoke=True)
        requests = {}
        tr.context[REQUESTS] = requests
        for r in [served for sub in live for served in sub.invokes]:
            try:
                inv = tr.invoke(r.input, *r.fns, **r.kwargs)
            except Exception as exc:  # this request's input or intervention is invalid: only it fails
                r.deliver(False, exc)
                continue
            requests[inv.index] = r
            if generating:
                seeds[inv.index] = r.gen.get("seed")
            r.attach(inv)
        if not requests:
            return
        if generating:
            tr.invoke(None, _GenerationWatch(self, requests))
        self._current = tr
        grad = any(getattr(fn, "needs_grad", False) for r in requests.values() for fn in r.fns)
        try:
            if grad:
                with torch.enable_grad():   # gradient requests (their key keeps them among themselves)
                    tr.run()
            elif self.no_grad:
                with torch.no_grad():
                    tr.run()
            else:
                tr.run()
        finally:
            self._current = None
        for r in requests.values():
            r.finish(model)


async def _next_item(sub, deadline):
    """The submission's next mailbox item; ``TimeoutError`` at ``deadline`` plus its credit
    (the time other requests' metered interventions held the worker meanwhile, see :class:`Meter`)."""
    if deadline is None:
        return await sub.mailbox.get()
    meter = sub.meter
    while True:
        try:
            with aio.fail_at(deadline + meter.credit()):
                return await sub.mailbox.get()
        except TimeoutError:
            if time.monotonic() >= deadline + meter.credit():
                raise
            # foreign code ran meanwhile: the deadline moved on; wait again (the item stays queued)


class _LiveListener:
    """Hears a live vLLM run's tokens, emitted values and end (in the engine loop's thread)."""

    __slots__ = ("batcher", "served")

    def __init__(self, batcher, served):
        self.batcher = batcher
        self.served = served

    def on_output(self, invoke) -> None:
        self.served.stream_tokens(self.batcher.model.tokenizer)

    def on_event(self, index, item) -> None:
        served = self.served
        served.emitted.append(item)
        if served.stream:
            served.event(item)

    def on_finish(self, run) -> None:
        self.batcher.finish_live(self.served, run)


class EventStream:
    """An ``async for`` over one streaming request's events, ending with ``{"event": "done", "result": ...}``.

    Leaving it early (``aclose``, ``async with``, an exception in the loop)
    cancels the request. Subclasses say where the next item comes from
    (``_next``: ``(kind, ok, value)``) and how to cancel (``_cancel``).
    """

    done = False

    def _next(self):
        """An awaitable of the next ``(kind, ok, value)``."""
        raise NotImplementedError

    def _cancel(self) -> None:
        raise NotImplementedError

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.done:
            raise StopAsyncIteration
        try:
            kind, ok, value = await self._next()
        except BaseException:
            await self.aclose()
            raise
        if kind == "event":
            return value
        self.done = True
        if not ok:
            raise value
        return {"event": "done", "result": value}

    async def aclose(self):
        """Stop listening; cancels the request if it has not finished."""
        self.done = True
        self._cancel()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()


class GenerationStream(EventStream):
    """Async iterator over a streaming submission's events (see :meth:`Batcher.stream_generate`)."""

    def __init__(self, batcher, sub, deadline):
        self._batcher = batcher
        self._sub = sub
        self._deadline = deadline

    def _next(self):
        return _next_item(self._sub, self._deadline)

    def _cancel(self) -> None:
        self._sub.cancel()
        self._batcher.unqueue(self._sub)


class _GenerationWatch:
    """A whole-batch helper invoke of a shared generation: tracks each request's tokens after every step.

    It installs a tap on ``m.tokens`` (called after the requests' own tasks
    have seen the step's tokens); a request that has its ``max_new_tokens``
    tokens, or whose rows all produced an end-of-sequence token or completed
    a string of its ``stop`` option, leaves the run there
    (``Kernel.end_group``) and gets its result at once.
    """

    def __init__(self, batcher, requests):
        self.run = None               # the run hosting the generation, once it starts
        self.requests = requests
        self.tokenizer = batcher.model.tokenizer
        self.eos = eos_ids(batcher.model)
        self.__qualname__ = self.__name__ = "serve-generation-watch"

    async def __call__(self, m):
        run = self.run = current_run()
        run.tap(m.logits, self._on_logits)
        run.tap(m.tokens, self._on_tokens)
        return None

    def _on_logits(self, _):
        """Which invokes were stopped before this step's token was chosen (as locally, they get no token)."""
        self.before = frozenset(self.run.stopped_invokes)

    before = frozenset()

    def _ended(self, row_tokens, eos, stops) -> bool:
        """Whether a row ends with an end-of-sequence token or its text has a stop string (``stop`` option)."""
        if row_tokens[-1] in eos:
            return True
        return bool(stops) and stop_hit(self.tokenizer.decode(row_tokens, skip_special_tokens=True), stops)

    def _on_tokens(self, ids):
        run = self.run
        kernel = run.kernel
        batch = run.batch
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        for idx, r in self.requests.items():
            if r.finished or idx in kernel.ended:
                continue
            span = batch.spans[idx]
            rows = ids[span[0]:span[1]] if span is not None else ids
            if r.tokens is None:
                r.tokens = [[] for _ in rows]
            eos = () if r.gen.get("ignore_eos") else self.eos
            if idx in run.stopped_invokes:
                # m.stop() during this step: like a stopped run, no token from it, unless it stopped at the
                # tokens point itself (the token was chosen: a local run keeps it too)
                if idx not in self.before:
                    for row_tokens, t in zip(r.tokens, rows):
                        if len(row_tokens) < r.max_new_tokens and not (row_tokens and row_tokens[-1] in eos):
                            row_tokens.append(int(t))
                    r.stream_tokens(self.tokenizer)
                kernel.end_group(idx)
                r.finish_generation(self.tokenizer, early=True)
                continue
            stops = check_stop(r.gen.get("stop"))
            done_rows = 0
            for row_tokens, t in zip(r.tokens, rows):
                if row_tokens and self._ended(row_tokens, eos, stops):
                    done_rows += 1   # already finished: HF pads it, we keep what it generated
                    continue
                if len(row_tokens) < r.max_new_tokens:
                    row_tokens.append(int(t))
                if self._ended(row_tokens, eos, stops) or len(row_tokens) >= r.max_new_tokens:
                    done_rows += 1
            r.stream_tokens(self.tokenizer)
            if done_rows == len(r.tokens) and r.state != "cancelled":
                kernel.end_group(idx)
                if all(t.done for t in r.invoke.tasks):
                    r.finish_generation(self.tokenizer, early=True)
