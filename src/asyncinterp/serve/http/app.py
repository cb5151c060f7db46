"""The HTTP server: a Starlette app in front of a :class:`~asyncinterp.serve.Batcher`.

    server = ai.serve.Server(model, api_keys=["secret"])

    @server.intervention("steer")
    async def steer(m, module: ai.serve.ModulePath, strength: Annotated[float, ai.serve.Range(-20, 20)] = 4.0):
        ...

    server.run(port=8000)          # uvicorn on 127.0.0.1

Endpoints (POST bodies and answers are msgpack, see :mod:`.wire`; GETs answer JSON):

* ``GET  /v1/health`` — liveness and queue length (no key needed);
* ``GET  /v1/model`` — the module tree, the registered interventions and their parameters, limits;
* ``POST /v1/trace`` — ``{"input", "intervention", "timeout"?}`` → ``{"ok": true, "result"}``;
* ``POST /v1/generate`` — ``{"input", "intervention"?, "max_new_tokens", "stream"?, "timeout"?}`` →
  ``{"ok": true, "result", "tokens", "text", "emitted"}``, or with ``"stream": true`` a stream of
  msgpack maps: ``token`` and ``emit`` events as they are produced, then ``done`` (or ``error``);
* ``POST /v1/sessions`` — a captured ``async def session(model)`` run as one job (:mod:`.sessions`; with code);
* ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` — OpenAI-compatible
  (JSON, server-sent events when streaming; shapes in :mod:`..openai.openai_compat`, vLLM's sampling fields in
  :mod:`.sampling_fields`, logprobs and echo in :mod:`.logprobs`, several choices in
  :mod:`.choices`, ``response_format`` in :mod:`.structured`), the intervention in an ``asyncinterp`` field, with the same checks, limits,
  sandbox and batching as the native endpoints;
* ``POST /tokenize``, ``POST /detokenize``, ``GET /version`` — vLLM's (shapes in :mod:`.tokenize_api`);
* ``POST /v1/jobs`` — a whole job of N invokes with captured interventions (``ai.remote``; :mod:`.jobs_api`);
* ``GET /metrics`` — Prometheus text (:mod:`.metrics`): requests by endpoint and status, sandbox refusals,
  budget cuts, queue depth, worker restarts, and vLLM's own metrics when it records any.

``intervention`` is a registered name, ``{"name", "params"}``, or (only when
the server allows code) ``{"source", "entry"?, "params"}``.

Statuses: 200 ok; 400 malformed body, invalid parameters, refused code; 401
missing or wrong API key; 404/405 unknown route; 413 body too large; 422 the
intervention raised (the error's type, message and own traceback lines come
back); 503 queue full (with ``Retry-After``); 504 the request's time limit (extended by the time other
requests' submitted code held the worker) or its submitted code's compute budget. Every request is logged
as one structured record on the ``asyncinterp.serve`` logger.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import inspect
import logging
import os
import time

import torch
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ... import aio
from ...client import wire
from ..jobs import errors, jobs_api, owners, sessions
from ..jobs.errors import RequestFailed
from ..openai import batches as openai_batches, choices, model_names, openai_compat, receipts, structured, tokenize_api
from ..openai import logprobs as logprob_fields
from ..sandbox import ProgramCache, SandboxRefused, SandboxTimeout
from ..sandbox.gradients import check_no_grad_refusal
from ..scheduling.batcher import Batcher, BatcherFull
from ..scheduling.engine_front import front_for
from ..scheduling.params import BadRequest, MaxLen, ModulePath, Param, Range, Registered, short_repr  # noqa: F401
from ..workers import confine
from . import capabilities
from .direct import DirectJobs
from ..jobs.event_stream import INTERVENTION_ERRORS, EventStreamResponse, stream_events
from .metrics import ServerMetrics
from .reach import JsonFormatter, is_loopback  # noqa: F401 (their home was here)

log = logging.getLogger("asyncinterp.serve")

MSGPACK = "application/msgpack"
MSGPACK_STREAM = "application/x-msgpack-stream"
CLIENT_GONE = errors.status_of("client_disconnect")   # logged for a request whose client left (499)


# --------------------------------------------------------------------------- responses
def _msgpack(obj, status=200, headers=None):
    return Response(wire.packb(obj), status_code=status, media_type=MSGPACK, headers=headers)


def _error_response(fail: RequestFailed):
    return _msgpack({"ok": False, "error": fail.error}, fail.status, fail.headers)


def _openai_error_response(fail: RequestFailed):
    return JSONResponse(openai_compat.error_body(fail.status, fail.error, fail.param), fail.status,
                        errors.openai_headers(fail.status, fail.headers))


_MODEL_WORK = frozenset({"trace", "generate", "completions", "chat.completions", "job", "session"})
_OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/version",
                 "/metrics")


# --------------------------------------------------------------------------- the server
class Server:
    """Serve ``model`` over HTTP: named interventions, optional submitted code, dynamic batching.

    ``api_keys``: accepted keys (``Authorization: Bearer KEY`` or
    ``X-API-Key: KEY``); none means no authentication (only sensible on
    loopback). ``allow_code``: accept client-submitted ``async def`` source
    (restricted, see :mod:`..sandbox`). ``timeout``: per-request limit in
    seconds (clients may ask for less). ``code_budget``: CPU seconds that
    submitted code may run per request, counted only while its own code
    runs (a request's ``timeout`` lowers it); past it the code is stopped
    there (504) and the forward goes on for the others, whose deadlines
    are extended by the time it held the worker. ``max_body_bytes``: larger bodies get
    413. ``max_queue``: waiting requests beyond it get 503. Batching:
    ``max_batch``, ``max_wait_ms``, ``exact`` (see :class:`Batcher`).
    ``builtin_interventions``: register ``top_k``, ``read``, ``steer`` and
    ``ablate`` (language models). ``isolation``: ``"thread"`` (default: the
    model runs in this process, on the batcher's thread) or ``"process"`` /
    a :class:`~..workers.supervisor.ProcessIsolation`: the model and every
    intervention run in supervised worker processes that are killed and
    restarted when they hang, crash or run out of memory (see
    :mod:`..workers.supervisor`); this process keeps checking requests as before.
    ``prompt_tokens_details``: OpenAI answers report
    ``usage.prompt_tokens_details.cached_tokens`` (prompt tokens the engine
    took from its prefix cache; vLLM only). Off by default, as in vLLM's
    server: the count tells a client whether *other* clients sent the same
    prompt prefix (see docs/serving.md, "Prefix cache").
    """

    def __init__(self, model, *, api_keys=None, allow_code: bool = False, max_batch: int = 32,
                 max_wait_ms: float = 5.0, max_queue: int = 256, timeout: float = 30.0, code_budget: float = 1.0,
                 max_body_bytes: int = 1 << 20, max_new_tokens: int = 256, max_prompt_tokens: int | None = None,
                 exact: bool = False, name: str | None = None, builtin_interventions: bool = True,
                 batcher: Batcher | None = None, isolation="thread", prompt_tokens_details: bool = False):
        self.model = model
        self.prompt_tokens_details = bool(prompt_tokens_details)
        self.name = name or type(getattr(model, "module", model)).__name__
        self.api_keys = [k.encode() for k in (api_keys or []) if k]
        self.allow_code = allow_code
        self.timeout = float(timeout)
        self.code_budget = float(code_budget)
        if not self.code_budget > 0:
            raise ValueError(f"code_budget must be a positive number of seconds, got {code_budget!r}")
        self.max_body_bytes = int(max_body_bytes)
        self.max_new_tokens = int(max_new_tokens)
        self.front = front_for(model)       # what differs per engine kind (transformers, vLLM), decided once
        self.is_lm = self.front.generates
        self.max_prompt_tokens = max_prompt_tokens or self.front.context_length or 4096
        self.limits = wire.Limits(max_bytes=self.max_body_bytes)
        self.supervised = isolation != "thread"
        if self.supervised and batcher is None:
            from ..workers.supervisor import Supervisor
            batcher = Supervisor(self, isolation, max_batch=max_batch, max_wait_ms=max_wait_ms,
                                 max_queue=max_queue, exact=exact, name=f"serve-{self.name}")
        self.batcher = batcher or Batcher(model, max_batch=max_batch, max_wait_ms=max_wait_ms, max_queue=max_queue,
                                          exact=exact, name=f"serve-{self.name}")
        self.metrics = ServerMetrics(self.batcher, vllm=getattr(model, "llm_engine", None)   # its own registry
                                     if self.front.kind == "vllm" else None)
        self.interventions: dict[str, Registered] = {}
        self.names = model_names.ModelNames(self.name)      # served model names: edits, adapters
        self.receipts = receipts.Receipts(getattr(model, "module", model), self.front.kind, self.name,
                                          self.interventions)
        self.programs = ProgramCache()
        self.confinement = confine.at_start(self)     # whether submitted code runs confined (said at start)
        self._app = None
        self.started = int(time.time())
        if builtin_interventions and self.is_lm:
            from ..scheduling.builtins import register_builtins
            register_builtins(self)

    # ------------------------------------------------------------------ registration
    def intervention(self, name: str | None = None, *, doc: str | None = None):
        """Decorator: register an ``async def fn(m, **typed_params)`` under ``name`` (default: its name)."""

        def deco(fn):
            key = name or fn.__name__
            if key in self.interventions:
                raise ValueError(f"an intervention named {key!r} is already registered")
            self.interventions[key] = Registered(key, fn, doc)
            return fn
        return deco

    def add_intervention(self, name: str, fn, doc: str | None = None) -> None:
        self.intervention(name, doc=doc)(fn)

    def add_edit(self, name: str, fn=None, *, intervention: str | None = None, params: dict | None = None):
        """Install a named edit, chosen by OpenAI requests as ``model="NAME:name"`` (see :mod:`..openai.model_names`):
        ``fn`` an ``async def fn(m)`` run once per forward pass, or a registered ``intervention`` with fixed
        ``params``."""
        return model_names.install_edit(self, name, fn, intervention=intervention, params=params)

    # ------------------------------------------------------------------ app
    @property
    def app(self) -> Starlette:
        if self._app is None:
            self._app = self._build_app()
        return self._app

    @property
    def max_prompt_chars(self) -> int:
        """The longest prompt string tokenized at all (longer ones are refused before the tokenizer sees them)."""
        return self.max_prompt_tokens * 64

    @property
    def asgi(self):
        """What the server's own uvicorn runs: :attr:`app`, with ``POST /v1/jobs`` (every remote trace) answered
        before Starlette's middleware and router (:mod:`.direct`)."""
        return DirectJobs(self.app, jobs_api.endpoint(self))

    def _build_app(self):
        # the router tries routes in order: the busiest first (each route tried costs a match per request)
        routes = [
            *jobs_api.routes(self),      # POST /v1/jobs: a whole job (ai.remote), see jobs_api
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/chat/completions", self._chat_completions, methods=["POST"]),
            Route("/v1/health", self._health, methods=["GET"]),
            Route("/v1/model", self._model_info, methods=["GET"]),
            Route("/v1/trace", self._trace, methods=["POST"]),
            Route("/v1/generate", self._generate, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/tokenize", self._tokenize, methods=["POST"]),
            Route("/detokenize", self._detokenize, methods=["POST"]),
            Route("/version", self._version, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
            *capabilities.routes(self),  # GET /v1/capabilities: the served model's points, probed once
            Route("/v1/sessions", functools.partial(sessions.session_endpoint, self), methods=["POST"]),
            *openai_batches.routes(self),   # OpenAI's files and batches, runtime edits (on the kept-jobs store)
        ]
        routes += self.durable.routes() if self.durable is not None else []   # kept jobs (serve/jobs/durable)

        async def http_error(request, exc):
            render = _openai_error_response if request.url.path.rstrip("/") in _OPENAI_PATHS else _error_response
            return render(errors.routing_failure(exc.status_code, exc.detail or "not found"))

        async def startup():
            if self.durable is not None:
                await self.durable.start()

        async def shutdown():
            if self.durable is not None:
                await self.durable.aclose()
            await self.batcher.aclose()

        return Starlette(routes=routes, exception_handlers={HTTPException: http_error}, on_startup=[startup],
                         on_shutdown=[shutdown]) \
            if _takes_on_shutdown() else Starlette(routes=routes, exception_handlers={HTTPException: http_error},
                                                    lifespan=_lifespan(shutdown, startup))

    def run(self, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
            allow_non_loopback: bool = False, **uvicorn_kwargs) -> None:
        """Serve with uvicorn (blocking), on a loopback address unless ``allow_non_loopback``."""
        if not is_loopback(host) and not allow_non_loopback:
            raise ValueError(f"refusing to bind {host!r}: only loopback addresses unless allow_non_loopback=True "
                             "(and then put TLS and real authentication in front)")
        import uvicorn
        uvicorn.run(self.asgi, host=host, port=port, log_level=log_level, access_log=False, **uvicorn_kwargs)

    durable = None    # the kept-jobs service (serve/jobs/durable), when jobs are kept (--state-dir / --database)

    # ------------------------------------------------------------------ endpoint plumbing
    def _check_key(self, request):
        if not self.api_keys:
            return
        got = request.headers.get("x-api-key")
        if got is None:
            auth = request.headers.get("authorization", "")
            if auth[:7].lower() == "bearer ":
                got = auth[7:].strip()
        if not got:
            raise RequestFailed("auth",
                                "an API key is required: send `Authorization: Bearer KEY` or `X-API-Key: KEY`")
        given = got.encode("utf-8", "replace")
        if not any(hmac.compare_digest(given, k) for k in self.api_keys):
            raise RequestFailed("auth", "invalid API key")

    async def _read_body(self, request) -> bytes:
        limit = self.max_body_bytes
        cl = request.headers.get("content-length")
        if cl is not None:
            try:
                n = int(cl)
            except ValueError:
                raise RequestFailed("request", "invalid Content-Length") from None
            if n > limit:
                raise RequestFailed("too_large", f"request body of {n} bytes exceeds the limit of {limit} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise RequestFailed("too_large", f"request body exceeds the limit of {limit} bytes")
        return bytes(body)

    def _decode(self, body: bytes) -> dict:
        if not body:
            raise RequestFailed("request", "empty body: send a msgpack map")
        try:
            obj = wire.unpackb(body, self.limits)
            wire.check_depth(obj)
        except wire.WireError as exc:
            raise RequestFailed("request", str(exc)) from None
        if not isinstance(obj, dict):
            raise RequestFailed("request", f"the body must be a msgpack map, got {type(obj).__name__}")
        for k in obj:
            if not isinstance(k, str):
                raise RequestFailed("request", "keys of the request map must be strings")
        return obj

    def _input(self, value, tokenized=None):
        """The checked input and its token count (0 for models without a tokenizer).

        A prompt string comes back as its token ids: the one tokenization of the request (the engine, the
        receipt and the answer's echo take the ids; nothing tokenizes it again). ``tokenized``: ids of prompts
        already tokenized together (``{prompt: ids}``, a job's prompts in one call of the tokenizer)."""
        if self.is_lm:
            if isinstance(value, str):
                if not value:
                    raise RequestFailed("request", "input: empty prompt")
                if len(value) > self.max_prompt_chars:
                    raise RequestFailed("request", "input: prompt too long")
                ids = tokenized.get(value) if tokenized else None
                try:
                    ids = list(self.model.tokenizer(value)["input_ids"] if ids is None else ids)   # (a list of its own)
                except Exception as exc:  # noqa: BLE001
                    raise RequestFailed("request", f"input: cannot tokenize ({type(exc).__name__})") from None
                n = len(ids)
                if n > self.max_prompt_tokens:
                    raise RequestFailed("request", f"input: prompt of {n} tokens exceeds {self.max_prompt_tokens}")
                if not ids:
                    raise RequestFailed("request", "input: the prompt has no tokens")
                return ids, n
            if isinstance(value, list) and value and all(type(t) is int for t in value):
                if len(value) > self.max_prompt_tokens:
                    raise RequestFailed("request", f"input: {len(value)} tokens exceed {self.max_prompt_tokens}")
                vocab = self.front.vocab_size()
                if any(t < 0 or t >= vocab for t in value):
                    raise RequestFailed("request", f"input: token ids must be in [0, {vocab})")
                return value, len(value)
            raise RequestFailed("request", "input must be a prompt string or a non-empty list of token ids")
        if isinstance(value, torch.Tensor):
            self._check_rows(value)
            return value, 0
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
            for v in value:
                self._check_rows(v)
            return tuple(value), 0
        raise RequestFailed("request", "input must be a tensor (or a list of tensors) for this model")

    def _check_rows(self, t) -> None:
        """A tensor input's batch dimension (dim 0) counts against ``max_batch``, as a list of prompts does."""
        rows = t.shape[0] if t.dim() else 1
        if rows > self.batcher.max_batch:
            raise RequestFailed("too_large", f"input: {rows} rows exceed max_batch={self.batcher.max_batch}: "
                                             "split them into several requests")

    def _check_new_tokens(self, length, n, param="max_new_tokens"):
        """Refuse a generation length outside ``[1, max_new_tokens]`` or past the model's context."""
        if type(n) is not int or not 1 <= n <= self.max_new_tokens:
            raise RequestFailed("request", f"{param} must be an int in [1, {self.max_new_tokens}]", param=param)
        ctx = self.front.context_length
        if ctx and length + n > ctx:
            raise RequestFailed("request", f"a prompt of {length} tokens + {n} new tokens exceeds the model's "
                                        f"context of {ctx}", param=param)

    def _intervention(self, spec, timeout, required=True):
        """What the batcher runs for a request's intervention spec; refuses before any model work."""
        bound = self.bind_intervention(spec, timeout, required)
        if self.supervised and bound[0] is not None:
            # checked here as always; a worker process binds it again and runs it
            return self.batcher.remote(spec), None, bound[2], None
        return bound

    def bind_intervention(self, spec, timeout, required=True):
        """``(fn, on_cancel, label, meter)`` for a request's intervention spec; refuses before any model work."""
        if spec is None:
            if required:
                raise RequestFailed("request", "an intervention is required: a registered name, {'name', 'params'}"
                                            + (" or {'source', 'params'}" if self.allow_code else ""))
            return None, None, None, None
        if isinstance(spec, str):
            spec = {"name": spec}
        if not isinstance(spec, dict):
            raise RequestFailed("request", "intervention must be a name or a map")
        allowed = {"name", "params", "source", "entry"}
        extra = [k for k in spec if k not in allowed]
        if extra:
            raise RequestFailed("request", f"unknown intervention field(s) {[short_repr(k) for k in extra]}")
        params = spec.get("params", {})
        if params is None:
            params = {}
        if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
            raise RequestFailed("request", "params must be a map with string keys")
        if "source" in spec:
            if not self.allow_code:
                raise RequestFailed("refused", "this server does not accept submitted code (start it with "
                                            "--allow-code); use a registered intervention (GET /v1/model)")
            source, entry = spec["source"], spec.get("entry")
            if not isinstance(source, str) or (entry is not None and not isinstance(entry, str)):
                raise RequestFailed("request", "source and entry must be strings")
            try:
                program = self.programs.get(source, entry)
                check_no_grad_refusal(program, self.front.kind)     # gradients need autograd (not vLLM)
                fn, clock = program.bind(params, time.monotonic() + timeout, min(self.code_budget, timeout))
            except SandboxRefused as exc:
                raise RequestFailed("refused", str(exc)) from None
            except Exception as exc:  # noqa: BLE001 - anything else in the module body
                raise RequestFailed("refused", f"submitted code failed to load: {type(exc).__name__}: {exc}") from None

            def on_cancel():
                clock.cancelled = True
            return fn, on_cancel, f"submitted:{program.entry}", clock
        name = spec.get("name")
        if not isinstance(name, str):
            raise RequestFailed("request", "intervention name must be a string")
        reg = self.interventions.get(name)
        if reg is None:
            raise RequestFailed("request", f"no intervention named {short_repr(name)}; registered: "
                                        f"{sorted(self.interventions)}")
        try:
            fn = reg.bind(params, self.model)
        except BadRequest as exc:
            raise RequestFailed("request", str(exc)) from None
        return fn, None, name, None

    def _timeout(self, obj):
        t = obj.get("timeout")
        if t is None:
            return self.timeout
        if type(t) not in (int, float) or not (t > 0) or t != t:
            raise RequestFailed("request", "timeout must be a positive number of seconds")
        return min(float(t), self.timeout)

    def _fields(self, obj, allowed):
        extra = [k for k in obj if k not in allowed]
        if extra:
            raise RequestFailed("request",
                                f"unknown field(s) {[short_repr(k) for k in extra]}; allowed: {sorted(allowed)}")

    async def _guarded(self, request, kind, work, render=_error_response, count=True):
        """Auth, logging, counting and error mapping around one endpoint; ``work()`` returns a Response.

        ``render(fail)``: the error response (msgpack for the native endpoints, OpenAI's JSON for theirs);
        ``count``: whether the request counts in ``/metrics`` (a scrape does not count itself, as in vLLM).
        """
        t0 = time.perf_counter()
        rid = request.headers.get("x-request-id") or os.urandom(8).hex()
        client = request.scope.get("client")   # (the scope's own values: no URL or Address object per request)
        fields = {"event": kind, "request_id": rid[:64], "path": request.scope["path"],
                  "client": client[0] if client else None}
        arrivals = getattr(self.batcher, "arrivals", None) if kind in _MODEL_WORK else None
        try:
            self._check_key(request)
            if arrivals is None:
                response = await work(fields)
            else:
                with arrivals.expect():   # a batch that starts meanwhile may wait for this request (max_wait_ms)
                    response = await work(fields)
            status = response.status_code
        except RequestFailed as fail:
            status = fail.status
            fields["error"] = fail.error.get("type")
            fields["error_kind"] = fail.kind
            response = render(fail)
        except ClientDisconnect:
            # the client went away while sending its body: nothing to answer, nothing went wrong here
            status = CLIENT_GONE
            fields["disconnected"] = True
            fields["error_kind"] = "client_disconnect"
            response = Response(status_code=CLIENT_GONE)
            log.info("client disconnected while sending its request body", extra={"fields": dict(fields)})
        except Exception as exc:  # noqa: BLE001 - never crash; report
            log.exception("internal error", extra={"fields": {"request_id": rid}})
            fail = RequestFailed("internal", f"internal server error ({type(exc).__name__})")
            status = fail.status
            fields["error"] = type(exc).__name__
            response = render(fail)
        fields["status"] = status
        fields["ms"] = round(1000 * (time.perf_counter() - t0), 2)
        response.headers["x-request-id"] = rid[:64]
        if count:
            self.metrics.answered(kind, status, fields.get("error_kind"))
        log.info(kind, extra={"fields": fields})
        return response

    async def _until_disconnect(self, request, fn) -> aio.Watched:
        """Run ``fn()``; if the client disconnects first, cancel it (its request is cancelled in the batcher)."""

        async def disconnected():
            while True:
                message = await request.receive()
                if message.get("type") == "http.disconnect":
                    return

        # an intervention may raise even SystemExit etc.: caught, it comes back in .exc
        return await aio.run_watched(fn, disconnected, catch=INTERVENTION_ERRORS)

    async def _respond(self, request, fields, call, answer) -> Response:
        """Await ``call()`` unless the client disconnects (499); ``answer(value)`` as the response (a map is
        sent as msgpack; a Response as it is). An answer that cannot be encoded is the intervention's 422."""
        try:
            outcome = await self._until_disconnect(request, call)
        except BatcherFull as exc:
            raise errors.failure(exc) from None
        if outcome.stopped:
            fields["disconnected"] = True
            return Response(status_code=CLIENT_GONE)
        if outcome.exc is not None:
            raise errors.failure(outcome.exc)
        try:
            out = answer(outcome.value)
            return out if isinstance(out, Response) else Response(wire.packb(out), media_type=MSGPACK)
        except wire.WireError as exc:
            raise errors.failure(exc) from None

    # ------------------------------------------------------------------ endpoints
    async def _health(self, request):
        extra = self.batcher.health() if self.supervised else {}
        return JSONResponse({"status": "ok", "model": self.name, "queue": self.batcher.queue_size(),
                             "batches": self.batcher.stats["batches"], "confinement": self.confinement, **extra})

    async def _model_info(self, request):
        async def work(fields):
            module = self.model.module
            modules = [[n, type(m).__name__] for n, m in module.named_modules() if n][:20000]
            info = {
                "model": self.name, "class": type(module).__name__, "language_model": self.is_lm,
                "modules": modules, **jobs_api.model_versions(),
                "interventions": {k: v.describe() for k, v in self.interventions.items()},
                "allow_code": self.allow_code,
                "allowed_imports": list(__import__("asyncinterp.serve.sandbox", fromlist=["x"]).ALLOWED_MODULES)
                if self.allow_code else [],
                "limits": {"max_body_bytes": self.max_body_bytes, "timeout": self.timeout,
                           "code_budget": self.code_budget if self.allow_code else None,
                           "max_new_tokens": self.max_new_tokens, "max_prompt_tokens": self.max_prompt_tokens,
                           "max_batch": self.batcher.max_batch, "max_queue": self.batcher.max_queue},
            }
            return JSONResponse(info)
        try:
            self._check_key(request)
        except RequestFailed as fail:
            return JSONResponse({"ok": False, "error": fail.error}, fail.status, fail.headers)
        return await work({})

    async def _trace(self, request):
        async def work(fields):
            obj = self._decode(await self._read_body(request))
            self._fields(obj, {"input", "intervention", "timeout"})
            if "input" not in obj:
                raise RequestFailed("request", "missing field 'input'")
            x, _ = self._input(obj["input"])
            timeout = self._timeout(obj)
            fn, on_cancel, label, meter = self._intervention(obj.get("intervention"), timeout)
            fields["intervention"] = label
            receipt = self.receipts.make(self.name, None, obj.get("intervention"), None, ("trace", x))
            call = functools.partial(self.batcher.trace, x, fn, timeout=timeout, on_cancel=on_cancel, meter=meter,
                                     owner=owners.owner(self, request), receipt=receipt)
            return await self._respond(request, fields, call,
                                       lambda value: {"ok": True, "result": value, "receipt": receipt})
        return await self._guarded(request, "trace", work)

    async def _generate(self, request):
        async def work(fields):
            if not self.is_lm:
                raise RequestFailed("request", "this model does not generate (it is not a LanguageModel)")
            obj = self._decode(await self._read_body(request))
            self._fields(obj, {"input", "intervention", "timeout", "max_new_tokens", "stream"})
            if "input" not in obj:
                raise RequestFailed("request", "missing field 'input'")
            x, length = self._input(obj["input"])
            n = obj.get("max_new_tokens", 20)
            self._check_new_tokens(length, n)
            stream = obj.get("stream", False)
            if type(stream) is not bool:
                raise RequestFailed("request", "stream must be a bool")
            timeout = self._timeout(obj)
            fn, on_cancel, label, meter = self._intervention(obj.get("intervention"), timeout, required=False)
            fields["intervention"] = label
            fields["max_new_tokens"] = n
            fns = (fn,) if fn is not None else ()
            receipt = self.receipts.make(self.name, None, obj.get("intervention"), None, ("generate", x, n))
            envelope = dict(timeout=timeout, on_cancel=on_cancel, meter=meter, owner=owners.owner(self, request),
                            receipt=receipt)
            if stream:
                try:
                    events = self.batcher.stream_generate(x, *fns, max_new_tokens=n, **envelope)
                except BatcherFull as exc:
                    raise errors.failure(exc) from None
                fields["stream"] = True
                return EventStreamResponse(self._stream(events, functools.partial(_msgpack_event, receipt=receipt),
                                                        mark_final=True), media_type=MSGPACK_STREAM)
            call = functools.partial(self.batcher.generate, x, *fns, max_new_tokens=n, **envelope)

            def answer(g):
                return {"ok": True, "result": g.result, "tokens": g.tokens, "text": g.text,
                        "emitted": [{"step": e["step"], "value": e["value"]} for e in g.emitted], "receipt": receipt}
            return await self._respond(request, fields, call, answer)
        return await self._guarded(request, "generate", work)

    def _stream(self, events, encode=None, encode_error=None, end_on_error=False, mark_final=False, first=None):
        """The body of a streaming answer (:func:`~..jobs.event_stream.stream_events`); msgpack maps unless given."""
        return stream_events(events, encode or _msgpack_event, encode_error or _msgpack_stream_error,
                             end_on_error, mark_final, first)

    # ------------------------------------------------------------------ OpenAI-compatible endpoints
    async def _completions(self, request):
        return await self._guarded(request, "completions", functools.partial(self._openai, request, "completions"),
                                   _openai_error_response)

    async def _chat_completions(self, request):
        return await self._guarded(request, "chat.completions", functools.partial(self._openai, request, "chat"),
                                   _openai_error_response)

    async def _models(self, request):
        async def work(fields):
            return JSONResponse(model_names.models_list(self.names, self.started))
        return await self._guarded(request, "models", work, _openai_error_response)

    # ------------------------------------------------------------------ vLLM's extra endpoints
    def _plain_body(self, body):
        """A JSON body of vLLM's extra endpoints, or the request's 400/404 as an OpenAI error."""
        try:
            obj = openai_compat.decode_body(body)
            if isinstance(obj.get("model"), str):
                self.names.resolve(obj["model"])      # the model or a name of its edits (tokenized alike)
            else:
                tokenize_api.check_model(obj, self.name)
        except BadRequest as exc:
            raise RequestFailed("request", str(exc), param=getattr(exc, "param", None)) from None
        except LookupError as exc:
            raise RequestFailed("not_found", f"{exc} (GET /v1/models)", param="model") from None
        return obj

    def _tokenizer(self):
        tok = getattr(self.model, "tokenizer", None)
        if not self.is_lm or tok is None:
            raise RequestFailed("request", "this model has no tokenizer (it is not a language model)")
        return tok

    async def _tokenize(self, request):
        async def work(fields):
            tok = self._tokenizer()
            obj = self._plain_body(await self._read_body(request))
            try:
                out = tokenize_api.tokenize(obj, tok, self.front.context_length or self.max_prompt_tokens,
                                            openai_compat.check_messages)
            except BadRequest as exc:
                raise RequestFailed("request", str(exc), param=getattr(exc, "param", None)) from None
            return JSONResponse(out)
        return await self._guarded(request, "tokenize", work, _openai_error_response)

    async def _detokenize(self, request):
        async def work(fields):
            tok = self._tokenizer()
            obj = self._plain_body(await self._read_body(request))
            try:
                out = tokenize_api.detokenize(obj, tok, self.front.vocab_size())
            except BadRequest as exc:
                raise RequestFailed("request", str(exc), param=getattr(exc, "param", None)) from None
            return JSONResponse(out)
        return await self._guarded(request, "detokenize", work, _openai_error_response)

    async def _version(self, request):
        async def work(fields):
            return JSONResponse(tokenize_api.version(self.front.kind))
        return await self._guarded(request, "version", work, _openai_error_response)

    async def _metrics(self, request):
        async def work(fields):
            return Response(self.metrics.render(), media_type=self.metrics.content_type)
        return await self._guarded(request, "metrics", work, _openai_error_response, count=False)

    def _selection(self, name):
        """The edits and adapter a request's ``model`` names (404 for an unknown name, listing the known ones)."""
        try:
            selection = self.names.resolve(name)
        except LookupError as exc:
            raise RequestFailed("not_found", str(exc), param="model") from None
        adapter = selection.adapter
        if adapter is not None and adapter.name not in getattr(getattr(self.model, "lora", None), "requests", {}):
            raise RequestFailed("request", f"the model {name!r} names the LoRA adapter {adapter.name!r}, but this "
                                           f"server's {self.front.kind} engine does not apply it per request (vLLM "
                                           "engines do: serve with --engine vllm); use the base model's name",
                                param="model")
        return selection

    async def _openai(self, request, kind, fields):
        """One OpenAI request: its shapes come from :mod:`..openai.openai_compat`; input, intervention, limits, batching
        and errors go through the same methods as ``/v1/generate``."""
        if not self.is_lm:
            raise RequestFailed("request", "this model does not generate (it is not a language model)")
        try:
            req = openai_compat.parse_request(kind, openai_compat.decode_body(await self._read_body(request)),
                                              self.interventions, self.front.vocab_size())
            engine_options = self.front.sampling_options(req.fields)   # refuses what this engine cannot honour
            engine_options.update(logprob_fields.engine_options(req.logprobs))
            engine_options.update(structured.engine_options(req.structured, self.front.kind))
            selection = self._selection(req.model)
            if selection.adapter is not None:     # the engine applies it to this request's tokens (vLLM LoRA)
                engine_options["adapter"] = selection.adapter.name
            prompts = req.prompts if req.messages is None else [
                openai_compat.chat_prompt(self.model.tokenizer, req.messages)]
        except BadRequest as exc:
            raise RequestFailed("request", str(exc), param=getattr(exc, "param", None)) from None
        inputs = []
        for prompt in prompts:
            try:
                x, length = self._input(prompt)
            except RequestFailed as fail:   # the same checks as /v1/generate; OpenAI's errors name the field at fault
                fail.param = "prompt" if req.messages is None else "messages"
                raise
            n = req.max_tokens
            if n is None:   # chat without a limit: as much as the server and the context allow
                ctx = self.front.context_length
                n = max(1, min(self.max_new_tokens, ctx - length)) if ctx else self.max_new_tokens
            self._check_new_tokens(length, n, req.max_tokens_param)
            inputs.append((prompt, x, length, n))
        try:
            timeout = self._timeout({"timeout": req.timeout})
            fn, on_cancel, label, meter = self._intervention(req.intervention, timeout, required=False)
        except RequestFailed as fail:
            fail.param = openai_compat.EXT
            raise
        fields.update(intervention=label, max_new_tokens=n, model=req.model)
        # the model name's edits run first in the request's invoke; alone, they share a prefix-cache scope
        edits = self.batcher.remote_edits(selection.edits) if self.supervised else selection.fns   # by name to workers
        fns = edits + ((fn,) if fn is not None else ())
        scope = selection.scope if fn is None else None

        def make_shaper(prompt, n, length, generate, ids=None):
            receipt = self.receipts.make(req.model, selection, req.intervention, generate.get("seed"),
                                         (req.kind, prompt, n, {**generate, **engine_options}, req.fields, req.stop))
            return choices.shaper(self, req, prompt, n, length, fn is not None, receipt, len(selection.edits), ids)
        envelope = dict(timeout=timeout, on_cancel=on_cancel, meter=meter, owner=owners.owner(self, request))
        if len(inputs) > 1 or req.n > 1:
            return await choices.respond(self, request, fields, req, inputs, fns, make_shaper, scope,
                                         dict(envelope, **engine_options))
        prompt, x, length, n = inputs[0]
        shaper = make_shaper(prompt, n, length, req.generate, x)
        x = self.front.generation_input(x, req.cache_salt, scope)
        options = dict(max_new_tokens=n, receipt=getattr(shaper, "receipt", None), **envelope,
                       **{**req.generate, **engine_options})
        if req.stream:
            try:
                events = self.batcher.stream_generate(x, *fns, **options)
            except BatcherFull as exc:
                raise errors.failure(exc) from None
            fields["stream"] = True

            async def body():
                yield shaper.start()
                def stream_error(fail):
                    self.metrics.failed(fail.kind)     # the answer's status was 200; its failure still counts
                    return shaper.error(openai_compat.error_body(fail.status, fail.error, fail.param))

                chunks = self._stream(events, shaper.event, stream_error, end_on_error=True)
                async with contextlib.aclosing(chunks):    # closed (the request cancelled) when the client leaves
                    async for chunk in chunks:
                        yield chunk
            return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        call = functools.partial(self.batcher.generate, x, *fns, **options)
        return await self._respond(request, fields, call, lambda g: JSONResponse(shaper.response(g)))

    # the plumbing that endpoint modules registered beside these (jobs_api) share, by public names
    read_body, decode_body, check_fields, request_timeout, openai_work = _read_body, _decode, _fields, _timeout, _openai
    check_input, check_new_tokens, guarded, respond, stream_events = _input, _check_new_tokens, _guarded, _respond, _stream


def _msgpack_event(ev, receipt=None) -> bytes:
    if ev["event"] == "done":
        g = ev["result"]
        ev = {"event": "done", "ok": True, "result": g.result, "tokens": g.tokens, "text": g.text, "receipt": receipt}
    return wire.packb(ev)


def _msgpack_stream_error(fail: RequestFailed) -> bytes:
    return wire.packb({"event": "error", "ok": False, "status": fail.status, "error": fail.error})


def _takes_on_shutdown():
    return "on_shutdown" in inspect.signature(Starlette.__init__).parameters


def _lifespan(shutdown, startup=None):
    @contextlib.asynccontextmanager
    async def lifespan(app):
        if startup is not None:
            await startup()
        yield
        await shutdown()
    return lifespan


def serve_app(model, **kwargs) -> Starlette:
    """Shortcut: ``Server(model, **kwargs).app``."""
    return Server(model, **kwargs).app
