"""``POST /v1/jobs``: a whole job (N invokes, their captured interventions) as one request.

What ``ai.remote`` (:mod:`.remote`) sends. The body is a msgpack map:

* ``protocol``, ``asyncinterp``, ``python``: the client's versions (:mod:`.protocol`; an incompatible pair
  is a 400 ``VersionMismatch`` naming both);
* ``job``: the bytes of :func:`~.job_wire.dumps_job` (invokes, options, the capture);
* ``timeout``: seconds (at most the server's), for the whole job;
* ``stream``: answer as a stream of msgpack maps: ``token`` and ``emit`` events of every invoke as they
  are produced (tagged ``"invoke": i``), then ``done`` (or ``error``).

Every captured function is rebuilt through the sandbox (:class:`~.rebuild_sandbox.Sandboxed`: the
static check, instrumentation, private copies of captured values, the restricted model view) in the process
that runs it: a supervised server reads only the job's outline (:func:`~.job_wire.outline_job`) and its
worker process reads, checks and tokenizes it once (:func:`begin_in_worker`); a server without
``--allow-code`` accepts only interventions registered on it, by name. The job's invokes run as
one atomic group in the batcher (:mod:`.groups`): the same forward, never split across batches,
sharing futures as locally; other requests may share the forward. Limits count the whole job: the
body size (413), ``max_batch`` invokes (413), one time limit and one compute budget (504), the prompt
and generation lengths of every invoke (400).

The answer: ``{"ok": true, "results": [...]}``, one entry per invoke, in order:
``{"ok": true, "value"}`` (generation: plus ``tokens``, ``text``, ``emitted``) or
``{"ok": false, "error"}`` (the error map of :mod:`.errors`, with its ``kind``).
A session (an ``async def`` taking the model) can become another job kind here: the envelope and the
version check stay, the batcher runs its traces.
"""

from __future__ import annotations

import functools
import math
import types
import time

import torch

from starlette.responses import Response
from starlette.routing import Route

from ... import aio
from . import errors, owners, prompt_ids
from ...client import wire
from ...client.cache_wire import recorded_of
from .errors import RequestFailed
from ..scheduling.params import short_repr
from .job_wire import JobParts, outline_job, read_job
from ...job import InvokeSpec
from ..scheduling.submission import Envelope
from .event_stream import EventStreamResponse
from .durable.hook import submit_kept
from ...client.protocol import incompatible, versions
from ..scheduling.requests import Meter
from ..sandbox.rebuild import DescriptionRefused, DescriptionTooLarge
from ..sandbox.rebuild_sandbox import Sandboxed
from ..sandbox import SandboxRefused
from ..sandbox.gradients import check_no_grad_refusal

__all__ = ["routes"]

_FIELDS = frozenset({"protocol", "asyncinterp", "python", "job", "timeout", "stream"})
_GENERATION_OPTIONS = ("stop", "do_sample", "temperature", "top_k", "top_p", "seed")
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256
_FORWARD_KWARGS = frozenset({"logits_to_keep"})   # forward keyword arguments a job may give (ints)
DEFAULT_NEW_TOKENS = 20   # a generation that gives no max_new_tokens (as locally)
INLINE_CHECK_BYTES = 16 << 10   # jobs up to this size are read and checked on the event loop, without a thread hop
MSGPACK = "application/msgpack"
MSGPACK_STREAM = "application/x-msgpack-stream"


def routes(server) -> list:
    """The routes this module adds to ``server``'s app."""
    return [Route("/v1/jobs", endpoint(server), methods=["POST"])]


def endpoint(server):
    """``POST /v1/jobs`` of ``server``: ``await endpoint(server)(request)`` is its response (every failure
    included: the handler never raises, see ``Server._guarded``)."""
    return functools.partial(_jobs, server)


def model_versions() -> dict:
    """What ``GET /v1/model`` adds: the server's protocol, asyncinterp and Python versions."""
    return versions()


async def _jobs(server, request):
    async def work(fields):
        obj = server.decode_body(await server.read_body(request))
        if obj.pop("wait", True) is False:   # kept in the store, answered 202 with its id (serve/jobs/durable)
            return await submit_kept(server, request, obj, fields)
        server.check_fields(obj, _FIELDS)
        _check_versions(obj)
        data = obj.get("job")
        if not isinstance(data, bytes):
            raise RequestFailed("request", "'job' must be the bytes of asyncinterp.serve.jobs.job_wire.dumps_job")
        stream = obj.get("stream", False)
        if type(stream) is not bool:
            raise RequestFailed("request", "stream must be a bool")
        timeout = server.request_timeout(obj)
        if server.supervised:   # the worker process that runs the job reads and checks it, once (begin_in_worker)
            return await _in_worker(server, request, fields, data, stream, timeout)
        sandbox = Sandboxed(time.monotonic() + timeout, min(server.code_budget, timeout), server.model) \
            if server.allow_code else None
        # a small job is checked here (a source seen before is checked once per process: well under a
        # millisecond); a large one in a thread, so that the event loop (health checks, other requests) stays free
        job = await load_job_async(server, data, sandbox, timeout)
        owner = owners.owner(server, request)
        checked = _checked(server, job, owner)
        fields.update(kind=job.kind, invokes=len(checked.invokes), intervention="job")
        meter = on_cancel = None
        if sandbox is not None:
            meter = sandbox.clock

            def on_cancel():
                sandbox.clock.cancelled = True
        envelope = Envelope(owner, meter, timeout, None, on_cancel)
        if stream:
            try:
                events = server.batcher.events(server.batcher.start(checked, envelope, stream=True))
            except Exception as exc:  # noqa: BLE001 - BatcherFull and friends: the error table answers
                raise errors.failure(exc) from None
            fields["stream"] = True
            encode = functools.partial(_event, job.kind)
            return EventStreamResponse(server.stream_events(events, encode, mark_final=True), media_type=MSGPACK_STREAM)

        async def call():
            return await server.batcher.answer(server.batcher.start(checked, envelope))
        return await server.respond(request, fields, call, lambda outcomes: _answer(job.kind, outcomes))
    return await server.guarded(request, "job", work)


async def _in_worker(server, request, fields, data, stream, timeout) -> Response:
    """A supervised server passes the job on as the client wrote it, having read only its outline (kind,
    invokes, whether it carries code): the worker that runs it reads, checks and tokenizes it, once
    (:func:`begin_in_worker`), and a job it refuses is answered with that refusal's own status (400, 413...)."""
    outline = outline_of(server, data)
    fields.update(kind=outline.kind, invokes=outline.invokes, intervention="job")
    envelope = dict(code=outline.code, timeout=timeout, owner=owners.owner(server, request))
    if not stream:
        return await server.respond(request, fields, functools.partial(server.batcher.job, data, **envelope),
                                    _worker_answer)
    try:
        events = server.batcher.stream_job(data, **envelope)
    except Exception as exc:  # noqa: BLE001 - BatcherFull and friends: the error table answers
        raise errors.failure(exc) from None

    def streamed(first):
        fields["stream"] = True
        return EventStreamResponse(server.stream_events(events, _worker_event, mark_final=True, first=first),
                                   media_type=MSGPACK_STREAM)
    # the answer starts once the worker has accepted the job (its first event, as its batch begins): a refusal is a
    # plain error answer
    try:
        response = await server.respond(request, fields, events.__anext__, streamed)
    except BaseException:
        await events.aclose()
        raise
    if not isinstance(response, EventStreamResponse):   # the client went away first
        await events.aclose()
    return response


def outline_of(server, data):
    """The job's :class:`~.job_wire.JobOutline` (nothing compiled), or the 400 of a body that is not a job. A job
    with submitted code on a server that takes none is refused here, as :func:`_load` would."""
    try:
        outline = outline_job(data, server.limits)
    except (wire.WireError, TypeError, ValueError, KeyError) as exc:
        raise RequestFailed("request", f"this job cannot be read: {exc}") from None
    if outline.code and not server.allow_code:
        raise RequestFailed("refused", NO_CODE)
    return outline


def _worker_answer(results: bytes) -> Response:
    """The answer of a job a worker process ran: its results as the worker encoded them, not encoded again."""
    return Response(wire.packb_with({"ok": True}, "results", _encoded(results)), media_type=MSGPACK)


def _worker_event(ev) -> bytes:
    if ev["event"] == "accepted":   # its batch began (first, and again if it re-runs): nothing to say
        return b""
    if ev["event"] == "done":
        return wire.packb_with({"event": "done", "ok": True}, "results", _encoded(ev["result"]))
    return wire.packb(ev)


def _encoded(results) -> bytes:
    if not isinstance(results, bytes):
        raise wire.WireError(f"the worker process answered with a {type(results).__name__}, not encoded results")
    return results


def begin_in_worker(worker, jid, msg, timeout):
    """In a worker process (:mod:`.worker_proc`), as the job's message arrives: read, check and tokenize the job
    (the server read only its outline) and hand it to the worker's front as one submission, in the calling
    thread, without waiting (its forward may start at once). Returns the coroutine function that waits for its
    answer and returns the reply with the answer's results (a streaming job: its events as they come; the
    server hears that it was accepted from the "batch" message that starts its forward)."""
    server = worker.server
    runs_code = server.allow_code and worker.runs_code
    sandbox = Sandboxed(time.monotonic() + timeout, min(server.code_budget, timeout), server.model) \
        if runs_code else None
    job = _load(server, msg["job"], sandbox, timeout, None if runs_code or not server.allow_code else MISROUTED)
    checked = _checked(server, job, msg.get("owner"))
    meter = sandbox.clock if sandbox is not None else Meter()
    on_cancel = None
    if sandbox is not None:
        def on_cancel():
            sandbox.clock.cancelled = True
    envelope = Envelope(None, meter, timeout, None, on_cancel)
    replied = []
    stream = bool(msg.get("stream"))

    def reply_now(ok, outcomes):   # in the front's thread, as the answer arrives: no hop back to the event loop
        if ok:
            try:
                worker.reply_done(jid, _encoded_outcome_parts(job.kind, outcomes))
                replied.append(True)
            except Exception:  # noqa: BLE001 - the event loop answers it as usual (and reports what failed)
                pass
    worker.tags[meter] = jid     # (how the worker tells the server which requests a batch holds)
    try:
        # a streamed job: the server starts its answer when it hears that the job's batch began (the worker's
        # "batch" message, sent as the forward starts): no message of its own before the forward
        submission = worker.batcher.start(checked, envelope, stream=stream, on_answer=reply_now)
    except BaseException:
        worker.tags.pop(meter, None)
        raise

    async def finish() -> dict:
        try:
            if stream:
                events = worker.batcher.events(submission)
                try:
                    async for ev in events:
                        if ev["event"] == "done":
                            outcomes = ev["result"]
                            break
                        worker.send_event(jid, ev)
                finally:
                    await events.aclose()
            else:
                outcomes = await worker.batcher.answer(submission)
        finally:
            worker.tags.pop(meter, None)
        if replied:
            return worker.REPLIED
        # the results encoded once, here: the server passes these bytes on to the client as they are
        return {"t": "done", "id": jid, "ok": True, "value": _encoded_outcomes(job.kind, outcomes)}
    return finish


def _check_versions(obj) -> None:
    client = {k: obj.get(k) for k in ("protocol", "asyncinterp", "python")}
    why = incompatible(client, versions())
    if why:
        fail = RequestFailed("request", why)
        fail.error["type"] = "VersionMismatch"
        raise fail


NO_CODE = ("this server does not accept submitted code (start it with --allow-code); use interventions "
           "registered on it (GET /v1/model), by name")
MISROUTED = "a job with submitted code reached the worker process for registered interventions, which refused it"


def _load(server, data, sandbox, timeout, refusal=None):
    """The job's parts with every intervention rebuilt (sandboxed) or bound (registered by name): its one
    ``Job`` is made by the front, with the rest of its batch. Without a sandbox, submitted code is refused
    (``refusal``: an internal error's message instead of the 400 of a server that takes no code)."""
    def refuse_code(source, filename, namespace):
        if refusal is not None:
            raise RequestFailed("internal", refusal)
        raise RequestFailed("refused", NO_CODE)

    def named(spec):
        fn = server.bind_intervention({"name": spec.get("name"), "params": spec.get("params")}, timeout)[0]
        return fn

    try:
        job = read_job(data, limits=server.limits, compile_source=sandbox or refuse_code, named=named)
        if sandbox is not None and sandbox.clock.grad:
            check_no_grad_refusal(types.SimpleNamespace(needs_grad=True), server.front.kind)
        return job
    except RequestFailed:
        raise
    except SandboxRefused as exc:
        raise RequestFailed("refused", str(exc)) from None
    except DescriptionTooLarge as exc:
        raise RequestFailed("too_large", str(exc)) from None
    except (DescriptionRefused, wire.WireError, TypeError, ValueError, KeyError) as exc:
        raise RequestFailed("request", f"this job cannot be read: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - anything else while defining the captured functions
        raise RequestFailed("refused", f"captured code failed to load: {type(exc).__name__}: {exc}") from None


async def load_job_async(server, data, sandbox, timeout):
    """:func:`_load` on the event loop for a small job (a source seen before is checked once per process: well
    under a millisecond), in a thread for a large one, so that the event loop stays free."""
    if len(data) <= INLINE_CHECK_BYTES:
        return _load(server, data, sandbox, timeout)
    return await aio.to_thread(_load, server, data, sandbox, timeout)


def _checked(server, job, owner=None) -> JobParts:
    """The job as the front takes it (:meth:`~asyncinterp.serve.scheduling.batcher.Batcher.start`): every invoke's
    input checked (prompts tokenized, or their ids kept for ``owner``: :func:`_tokenized`), the job's options
    refused or kept (a generation's, with max_new_tokens)."""
    n = len(job.invokes)
    max_batch = server.batcher.max_batch
    if n == 0:
        raise RequestFailed("request", "this job has no invokes")
    if n > max_batch:
        raise RequestFailed("too_large", f"this job has {n} invokes; this server runs at most max_batch="
                                         f"{max_batch} in one forward: split it into several jobs")
    if job.kind == "generate" and not server.is_lm:
        raise RequestFailed("request", "this model does not generate (it is not a LanguageModel)")
    if job.context:
        raise RequestFailed("request", "a job's context does not travel to a server")
    invokes, longest = [], 0
    tokenized = _tokenized(server, job.invokes, owner)
    for i, spec in enumerate(job.invokes):
        if spec.background:
            raise RequestFailed("request", f"invoke {i}: persistent edits (model.edit) do not run remotely")
        if spec.options:
            raise RequestFailed("request", f"invoke {i}: per-invoke engine options are not accepted remotely")
        kwargs = dict(spec.kwargs)
        if set(kwargs) - _FORWARD_KWARGS or any(type(v) is not int or v < 0 for v in kwargs.values()):
            raise RequestFailed("request", f"invoke {i}: keyword arguments for the model's forward: only "
                                           f"{', '.join(sorted(_FORWARD_KWARGS))} (an int >= 0) remotely, got "
                                           f"{short_repr(sorted(map(str, kwargs)), 200)}")
        if job.kind == "generate" and kwargs:
            raise RequestFailed("request", f"invoke {i}: a generation takes no forward keyword arguments")
        if kwargs != dict(job.invokes[0].kwargs):
            raise RequestFailed("request", "the invokes of one job must agree on the model's keyword arguments "
                                           "(they run in one forward)")
        if spec.input is None:
            x = None
        else:
            try:
                x, length = _input(server, spec.input, tokenized)
            except RequestFailed as fail:
                fail.error["message"] = f"invoke {i}: {fail.error['message']}"
                raise
            longest = max(longest, length)
        invokes.append(InvokeSpec(x, spec.fns, kwargs))
    if all(spec.input is None for spec in invokes):
        raise RequestFailed("request", "every invoke of this job has no input: give at least one an input")
    rows = sum(_rows(spec.input) for spec in invokes if spec.input is not None)
    if rows > max_batch:
        raise RequestFailed("too_large", f"this job's inputs have {rows} rows; this server runs at most "
                                         f"max_batch={max_batch} in one forward: split it into several jobs")
    options = {}
    if job.kind == "generate":
        gen = dict(job.generation)
        max_new = gen.pop("max_new_tokens", DEFAULT_NEW_TOKENS)
        server.check_new_tokens(longest, max_new)
        for key, value in gen.items():
            _check_generation_option(key, value, gen)
        options = dict(gen, max_new_tokens=max_new)
    return JobParts(tuple(invokes), job.kind, job.on_error, False, options, {})


def _check_generation_option(key, value, gen) -> None:
    """A 400 naming the option for a value a generation cannot take (as vLLM's own checks refuse them)."""
    def bad(why):
        return RequestFailed("request", f"generation option {key}: {why}, got {short_repr(value)}", param=key)

    number = type(value) in (int, float)
    if key not in _GENERATION_OPTIONS:
        raise RequestFailed("request", f"generation option {short_repr(key)} is not accepted remotely; accepted: "
                                       f"max_new_tokens, {', '.join(_GENERATION_OPTIONS)}", param=str(key)[:60])
    if key == "do_sample" and type(value) is not bool:
        raise bad("must be true or false")
    if key == "temperature":
        if not number or not math.isfinite(value) or value < 0:
            raise bad("must be a finite number >= 0")
        if value == 0 and gen.get("do_sample") is True:
            raise bad("must be > 0 to sample (for greedy decoding leave do_sample false)")
    if key == "top_p" and (not number or not math.isfinite(value) or not 0 < value <= 1):
        raise bad("must be a number in (0, 1]")
    if key == "top_k" and (type(value) is not int or value < 0):
        raise bad("must be an int >= 0 (0: off)")
    if key == "seed" and (type(value) is not int or not -(2 ** 63) <= value < 2 ** 63):
        raise bad("must be a 64-bit int")
    if key == "stop":
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS or not all(
                isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise bad(f"must be a string or a list of at most {MAX_STOP_STRINGS} non-empty strings of at most "
                      f"{MAX_STOP_CHARS} characters")


def _tokenized(server, invokes, owner=None) -> dict:
    """``{prompt: token ids}`` for the job's prompt strings: those its ``owner`` sent before as they were kept
    (:mod:`.prompt_ids`; ``owner=None``: none kept), the others tokenized in one call of the tokenizer (each
    prompt still once; the checks of :meth:`~asyncinterp.serve.http.app.Server._input` run as for any prompt).
    A prompt left out (one alone and nothing kept, or where that call fails) is tokenized alone, and the one
    that fails is named."""
    if not server.is_lm:
        return {}
    prompts = {}
    for spec in invokes:
        for value in (spec.input if isinstance(spec.input, list) else [spec.input]):
            if isinstance(value, str) and value and len(value) <= server.max_prompt_chars:
                prompts[value] = None
    kept = prompt_ids.of(server.model.tokenizer) if owner is not None and prompts else None
    found = {}
    if kept is not None:
        for prompt in prompts:
            ids = kept.get(owner, prompt)
            if ids is not None:
                found[prompt] = ids
    missing = [p for p in prompts if p not in found]
    if not missing or (kept is None and len(missing) < 2):
        return found
    try:
        made = dict(zip(missing, map(list, server.model.tokenizer(missing)["input_ids"])))
    except Exception:  # noqa: BLE001 - tokenized one by one instead, which reports the prompt that fails
        return found
    if kept is not None:
        for prompt, ids in made.items():
            kept.put(owner, prompt, ids)
    return {**found, **made}


def _input(server, value, tokenized=None):
    """An invoke's checked input and its longest row in tokens: what ``/v1/trace`` takes, and for language
    models also what a local invoke takes (docs/language-models.md): a list of prompts, lists of token ids,
    an integer tensor of ids (1-D or 2-D), a tokenizer output (``input_ids`` and ``attention_mask``).
    ``tokenized``: the job's prompts tokenized together (:func:`_tokenized`)."""
    if not server.is_lm or isinstance(value, str):
        return server.check_input(value, tokenized)
    if isinstance(value, dict):
        extra = set(value) - {"input_ids", "attention_mask"}
        if extra or "input_ids" not in value:
            raise RequestFailed("request", "input: a tokenizer output has input_ids and optionally attention_mask, "
                                           f"got {sorted(map(str, value))}")
        ids, length = _input(server, value["input_ids"])
        mask = value.get("attention_mask")
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or not isinstance(ids, torch.Tensor) or mask.shape != ids.shape \
                    or not bool(((mask == 0) | (mask == 1)).all()):
                raise RequestFailed("request", "input: attention_mask must be a 0/1 tensor shaped like input_ids")
        return {**value, "input_ids": ids}, length
    if isinstance(value, torch.Tensor):
        if value.dtype not in (torch.int64, torch.int32) or value.dim() not in (1, 2) or value.numel() == 0:
            raise RequestFailed("request", "input: a tensor of token ids is a non-empty 1-D or 2-D integer tensor")
        if value.dim() == 2 and value.shape[0] > server.batcher.max_batch:
            raise RequestFailed("too_large", f"input: {value.shape[0]} rows exceed max_batch="
                                             f"{server.batcher.max_batch}: split them into several invokes or jobs")
        rows = value.view(-1, value.shape[-1]).tolist()
        for row in rows:
            server.check_input(row)
        return value, value.shape[-1]
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        if len(value) > server.batcher.max_batch:
            raise RequestFailed("too_large", f"input: {len(value)} rows exceed max_batch={server.batcher.max_batch}")
        checked = [server.check_input(v, tokenized) for v in value]
        return [x for x, _ in checked], max(n for _, n in checked)
    return server.check_input(value, tokenized)


def _rows(x) -> int:
    """The rows a checked input adds to the forward: a prompt or a 1-D tensor of ids is one."""
    if isinstance(x, dict):
        x = x["input_ids"]
    if isinstance(x, torch.Tensor):
        return x.shape[0] if x.dim() > 1 else 1
    if isinstance(x, tuple):      # a plain model's positional tensors: their batch dimension
        return max((_rows(v) for v in x), default=1)
    if isinstance(x, list) and x and not all(type(t) is int for t in x):
        return len(x)              # a list of prompts (strings or id lists)
    return 1


def _outcome(kind, ok, value) -> dict:
    if not ok:
        fail = errors.failure(value)
        return {"ok": False, "status": fail.status, "error": fail.error}
    if kind == "generate":
        return {"ok": True, "value": recorded_of(value.result), "tokens": value.tokens, "text": value.text,
                "emitted": [{"step": e["step"], "value": e["value"]} for e in value.emitted]}
    return {"ok": True, "value": recorded_of(value)}


def _outcomes(kind, outcomes) -> list:
    """Each invoke's entry; one whose result cannot be encoded gets its own error (the others keep theirs)."""
    return [entry for entry, _ in _checked_outcomes(kind, outcomes)]


def _encoded_outcomes(kind, outcomes) -> bytes:
    """:func:`_outcomes` as the msgpack bytes of their list (each entry encoded once)."""
    return b"".join(_encoded_outcome_parts(kind, outcomes))


def _encoded_outcome_parts(kind, outcomes) -> list:
    """:func:`_encoded_outcomes` in parts that follow one another (written out without being joined; a result
    tensor's elements are a view of its memory: :func:`~asyncinterp.client.wire.packb_parts`)."""
    entries = [parts for _, parts in _checked_outcomes(kind, outcomes)]
    return [wire.array_header(len(entries)), *(part for parts in entries for part in parts)]


def _checked_outcomes(kind, outcomes):
    """``(entry, its encoding in parts)`` for each outcome; an entry that cannot be encoded becomes its error."""
    for ok, value in outcomes:
        entry = _outcome(kind, ok, value)
        try:
            parts = wire.packb_parts(entry)
        except wire.WireError as exc:
            entry = _outcome(kind, False, exc)
            parts = [wire.packb(entry)]
        yield entry, parts


def _answer(kind, outcomes) -> Response:
    body = {"ok": True, "results": [_outcome(kind, ok, value) for ok, value in outcomes]}
    try:
        data = wire.packb(body)
    except wire.WireError:
        data = wire.packb({"ok": True, "results": _outcomes(kind, outcomes)})
    return Response(data, media_type=MSGPACK)


def _event(kind, ev) -> bytes:
    if ev["event"] == "done":
        body = {"event": "done", "ok": True, "results": [_outcome(kind, ok, value) for ok, value in ev["result"]]}
        try:
            return wire.packb(body)
        except wire.WireError:
            return wire.packb({**body, "results": _outcomes(kind, ev["result"])})
    return wire.packb(ev)


# what a job kept in the store runs through (serve/jobs/durable): the same loading, checks and answers
load_job, checked_job, outcomes_of, check_versions = _load, _checked, _outcomes, _check_versions
