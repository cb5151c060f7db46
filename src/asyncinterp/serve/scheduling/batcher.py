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
from .requests import REQUESTS, BatcherClosed, BatcherFull, GenerateResult, Ledger, Meter, Request, emit  # noqa: F401

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
    batch waits for requests that are on their way (:attr:`arrivals`: counted
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

    # ------------------------------------------------------------------ public
    async def trace(self, input, *fns, timeout: float | None = None, on_cancel=None, meter=None, **kwargs):
        """Run ``fns`` on ``input`` in a shared forward; returns what ``model.trace(input, *fns)`` returns.

        ``timeout`` (seconds) bounds this request only (``TimeoutError``),
        extended by the time other requests' metered interventions held the
        worker meanwhile (:class:`Meter`; at most by ``timeout`` again);
        ``on_cancel`` is called (in this event loop) if the request is
        cancelled or times out; ``meter``: the :class:`Meter` that this
        request's intervention reports its time to (submitted code's clock);
        ``kwargs`` go to the invoke.
        """
        req = self._make("trace", input, fns, kwargs, None, None, on_cancel, False, meter)
        return await self._wait(req, timeout)

    async def generate(self, input, *fns, max_new_tokens: int = 20, timeout: float | None = None,
                       on_cancel=None, meter=None, **generate_kwargs) -> GenerateResult:
        """Generate for ``input`` with ``fns`` in a shared generation; returns a :class:`GenerateResult`."""
        req = self._make_generate(input, fns, max_new_tokens, generate_kwargs, on_cancel, False, meter)
        return await self._wait(req, timeout)

    def stream_generate(self, input, *fns, max_new_tokens: int = 20, timeout: float | None = None,
                        on_cancel=None, meter=None, **generate_kwargs) -> "GenerationStream":
        """Like :meth:`generate`, as an async iterator of events while the generation runs.

        The request is queued at once (so :class:`BatcherFull` is raised
        here). Events are dicts: ``{"event": "token", "step", "token",
        "text"}`` for each generated token, ``{"event": "emit", "step",
        "value"}`` for each :func:`emit` of the intervention, and last
        ``{"event": "done", "result": GenerateResult}``. Errors are raised
        from the iterator; leaving the loop early (or ``aclose()``) cancels
        the request.
        """
        req = self._make_generate(input, fns, max_new_tokens, generate_kwargs, on_cancel, True, meter)
        return GenerationStream(self, req, self._deadline(timeout, req))

    async def group(self, kind, invokes, *, timeout: float | None = None, on_cancel=None, meter=None,
                    on_error: str = "stop", max_new_tokens: int | None = None, **generate_kwargs) -> list:
        """Run ``invokes`` (``(input, fns)`` or ``(input, fns, kwargs)``) as one atomic group: the same forward, never split.

        Returns one ``(ok, value)`` per invoke (see :mod:`.groups`); ``timeout``, ``on_cancel`` and
        ``meter`` cover the whole group (``"generate"``: ``max_new_tokens`` and generation options).
        """
        req = self._make_group(kind, invokes, on_cancel, meter, on_error, max_new_tokens, generate_kwargs, False)
        return await self._wait(req, timeout)

    def stream_group(self, kind, invokes, *, timeout: float | None = None, on_cancel=None, meter=None,
                     on_error: str = "stop", max_new_tokens: int | None = None, **generate_kwargs):
        """Like :meth:`group`, as an async iterator of its members' events (tagged ``"invoke": i``), then done."""
        req = self._make_group(kind, invokes, on_cancel, meter, on_error, max_new_tokens, generate_kwargs, True)
        return GenerationStream(self, req, self._deadline(timeout, req))

    def queue_size(self) -> int:
        return len(self._pending) + len(self._running)

    def close(self, timeout: float = 10.0) -> None:
        """Stop accepting requests; fail the queued ones; stop the running batch; join the worker."""
        with self._cond:
            self._closed = True
            pending = list(self._pending)
            self._pending.clear()
            self._cond.notify_all()
        for req in pending:
            req.deliver(False, BatcherClosed("the batcher was closed before this request ran"))
        run = self._current
        if run is not None:
            run.cancel()
        for run in list(self._running):
            run.cancel()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    # ------------------------------------------------------------------ submitting
    def _make(self, kind, input, fns, kwargs, gen, max_new_tokens, on_cancel, stream, meter=None):
        for fn in fns:
            if not callable(fn):
                raise TypeError(f"an intervention must be an async function taking the model envoy, got {fn!r}")
        grad = any(getattr(fn, "needs_grad", False) for fn in fns)   # gradient requests share runs only together
        if kind == "trace":
            key = ("trace", self._input_key(input), tuple(sorted((k, _freeze(v)) for k, v in kwargs.items())), grad)
        else:
            gen = _own_seed(gen)
            key = ("generate", self._input_key(input), _generation_key(gen))
        req = Request(kind, input, fns, kwargs, key, gen, max_new_tokens, on_cancel, stream, meter)
        req.meter.attach(self.ledger)
        self._submit(req)
        return req

    def _make_group(self, kind, invokes, on_cancel, meter, on_error, max_new_tokens, gen, stream):
        from .groups import Group
        if self._live:
            raise TypeError("a job of several invokes as one group is not available on a live engine (vLLM) yet")
        if not invokes or len(invokes) > self.max_batch:
            raise ValueError(f"a group has 1 to max_batch={self.max_batch} invokes, got {len(invokes)}")
        if kind == "generate":
            if not self._is_lm:
                raise TypeError("generation requests need a LanguageModel (with a tokenizer and generate)")
            key = ("generate", self._input_key(invokes[0][0]), _generation_key(gen))
        else:
            kwargs = invokes[0][2] if len(invokes[0]) > 2 else {}   # (the invokes of a job agree on them)
            grad = any(getattr(fn, "needs_grad", False) for invoke in invokes for fn in invoke[1])
            key = ("trace", self._input_key(invokes[0][0]), tuple(sorted((k, _freeze(v)) for k, v in kwargs.items())),
                   grad)
        if any(invoke[0] is None for invoke in invokes):
            # an invoke without input sees "the whole batch": the group runs in a batch of its own, so that batch
            # holds this job's rows only, never another request's
            key += (object(),)
        req = Group(kind, invokes, key, gen, max_new_tokens, on_cancel, stream, meter, on_error)
        if kind == "generate":
            for member in req.members:   # as locally: the job's seed for every invoke, or a fresh one for each
                member.gen = _own_seed(member.gen)
        req.meter.attach(self.ledger)
        self._submit(req)
        return req

    def _make_generate(self, input, fns, max_new_tokens, generate_kwargs, on_cancel, stream, meter=None):
        if not self._is_lm:
            raise TypeError("generation requests need a LanguageModel (with a tokenizer and generate)")
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        return self._make("generate", input, fns, {}, generate_kwargs, max_new_tokens, on_cancel, stream, meter)

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

    def _submit(self, req):
        submitted()
        if self._live:
            return self._start_live(req)
        with self._cond:
            if self._closed:
                raise BatcherClosed("the batcher is closed")
            if len(self._pending) >= self.max_queue:
                raise BatcherFull(f"{len(self._pending)} requests are waiting (max_queue={self.max_queue}); "
                                  "try again later")
            self._pending.append(req)
            if self._thread is None:
                self._thread = threading.Thread(target=self._worker, name=f"asyncinterp-{self.name}", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _deadline(self, timeout, req=None):
        timeout = self.timeout if timeout is None else timeout
        return None if timeout is None else time.monotonic() + timeout

    async def _wait(self, req, timeout):
        deadline = self._deadline(timeout, req)
        try:
            while True:
                kind, ok, value = await _next_item(req, deadline)
                if kind == "done":
                    break
        except BaseException:
            req.cancel()
            self.unqueue(req)
            self.stats["cancelled"] += 1
            raise
        if not ok:
            raise value
        return value

    def unqueue(self, req) -> None:
        """Take a (cancelled) request out of the queue, if it is still there."""
        with self._cond:
            try:
                self._pending.remove(req)
            except ValueError:
                pass

    # ------------------------------------------------------------------ live engines (vLLM)
    def _start_live(self, req):
        """Hand ``req`` to the engine now as a run of its own (it joins before the next engine step)."""
        model = self.model
        with self._cond:
            if self._closed:
                raise BatcherClosed("the batcher is closed")
            if len(self._running) >= self.max_queue + self.max_batch:
                raise BatcherFull(f"{len(self._running)} requests are in the engine (max_queue + max_batch = "
                                  f"{self.max_queue + self.max_batch}); try again later")
        req.start()
        try:
            # the job is built once, with everything up front: m.stop() ends this request only, the request
            # table for serve.emit and the listener that hears its tokens are part of it when it is frozen
            if req.kind == "generate":
                trace = Trace(model, "generate", "continue", stop_per_invoke=True,
                              generation=dict(req.gen, max_new_tokens=req.max_new_tokens))
            else:
                trace = Trace(model, "trace", "continue", stop_per_invoke=True)
            trace.listener = _LiveListener(self, req)
            inv = trace.invoke(req.input, *req.fns, **req.kwargs)
            trace.context[REQUESTS] = {inv.index: req}
            req.tokens = [inv.token_ids]      # the engine appends to it step by step
            run = trace.start()               # the job, frozen (nothing runs until it is submitted)
        except Exception as exc:  # noqa: BLE001 - this request's input or intervention is invalid
            req.deliver(False, exc)
            return
        with self._cond:
            self._running.add(run)
            running = len(self._running)
        self.stats["requests"] += 1
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], running)   # most runs in the engine at once
        req.attach(inv)
        try:
            model.submit(trace)
        except Exception as exc:  # noqa: BLE001 - e.g. the engine was closed
            with self._cond:
                self._running.discard(run)
            req.deliver(False, exc)

    def finish_live(self, req, run) -> None:
        """A live run ended (engine loop thread): deliver its request's result or error."""
        with self._cond:
            self._running.discard(run)
        if run.error is not None:
            err = run.error
            if isinstance(err, RunCancelled) or self._closed:
                err = BatcherClosed("the batcher was closed while this request ran")
            req.deliver(False, err)
        else:
            req.finish(self.model)

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
                for req in batch:
                    req.deliver(False, exc)

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
            while self.arrivals.count > 0:   # wait only for company that is on its way
                n = sum(r.size for r in self._pending if r.key == first.key and r.state == "queued")
                now = time.monotonic()
                if n >= self.max_batch or now >= deadline or self._closed:
                    break
                cond.wait(deadline - now)
            batch = []
            keep = collections.deque()
            size = 0   # invokes in the batch (a group is never split: it goes in whole or waits)
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
                for r in live:
                    r.deliver(False, BatcherClosed("the batcher was closed while this request ran"))
                return
            if len(live) == 1:
                live[0].deliver(False, exc)
                return
            # isolate the request that broke the shared run: rerun each alone
            self.stats["fallbacks"] += 1
            log.info("batch of %d failed (%s: %s); rerunning its requests one by one", len(live),
                     type(exc).__name__, exc)
            for r in live:
                if r.state != "running":
                    continue
                if hasattr(r, "reset"):   # a group: its members start again
                    r.reset()
                r.invoke = None
                r.tokens = None
                r.emitted = []
                if r.streamed:
                    r.event({"event": "restart"})   # its events so far came from the failed shared run
                r.streamed = 0
                try:
                    self._run([r])
                except BaseException as solo_exc:  # noqa: BLE001
                    r.deliver(False, solo_exc)
        log.debug("batch of %d ran in %.1f ms", len(live), 1000 * (time.perf_counter() - t0))

    def _run(self, live):
        model = self.model
        generating = live[0].kind == "generate"
        # m.stop() from one request ends that request only (its unfinished tasks are closed at the next hook
        # point, as a stopped run would leave them); the shared forward goes on for the others
        if generating:
            n_max = max(r.max_new_tokens for r in live)
            shared = {k: v for k, v in live[0].gen.items() if k != "seed"}   # (seeds are per request: SEEDS)
            run = Trace(model, "generate", "continue", stop_per_invoke=True,
                        generation=dict(shared, max_new_tokens=n_max))
            seeds = run.context[SEEDS] = {}
        else:
            run = Trace(model, "trace", "continue", stop_per_invoke=True)
        requests = {}
        run.context[REQUESTS] = requests
        for r in [m for g in live for m in getattr(g, "members", (g,))]:   # a group: each of its invokes
            try:
                inv = run.invoke(r.input, *r.fns, **r.kwargs)
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
            run.invoke(None, _GenerationWatch(self, requests))
        self._current = run
        grad = any(getattr(fn, "needs_grad", False) for r in requests.values() for fn in r.fns)
        try:
            if grad:
                with torch.enable_grad():   # gradient requests (their key keeps them among themselves)
                    run.run()
            elif self.no_grad:
                with torch.no_grad():
                    run.run()
            else:
                run.run()
        finally:
            self._current = None
        for r in requests.values():
            r.finish(model)


async def _next_item(req, deadline):
    """The request's next mailbox item; ``TimeoutError`` at ``deadline`` plus the request's credit
    (the time other requests' metered interventions held the worker meanwhile, see :class:`Meter`)."""
    if deadline is None:
        return await req.mailbox.get()
    meter = req.meter
    while True:
        try:
            with aio.fail_at(deadline + meter.credit()):
                return await req.mailbox.get()
        except TimeoutError:
            if time.monotonic() >= deadline + meter.credit():
                raise
            # foreign code ran meanwhile: the deadline moved on; wait again (the item stays queued)


class _LiveListener:
    """Hears a live vLLM run's tokens, emitted values and end (in the engine loop's thread)."""

    __slots__ = ("batcher", "req")

    def __init__(self, batcher, req):
        self.batcher = batcher
        self.req = req

    def on_output(self, invoke) -> None:
        self.req.stream_tokens(self.batcher.model.tokenizer)

    def on_event(self, index, item) -> None:
        req = self.req
        req.emitted.append(item)
        if req.stream:
            req.event(item)

    def on_finish(self, run) -> None:
        self.batcher.finish_live(self.req, run)


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
    """Async iterator over a streaming generation request's events (see :meth:`Batcher.stream_generate`)."""

    def __init__(self, batcher, req, deadline):
        self._batcher = batcher
        self._req = req
        self._deadline = deadline

    def _next(self):
        return _next_item(self._req, self._deadline)

    def _cancel(self) -> None:
        self._req.cancel()
        self._batcher.unqueue(self._req)


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
