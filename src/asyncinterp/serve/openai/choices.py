"""Several choices in one OpenAI answer: ``n`` > 1, and a list of prompts in ``/v1/completions``.

Why this module exists: programs written for vLLM's server send a list of
prompts (evaluation harnesses score a batch of continuations in one request)
and ``n`` > 1 (several samples of one prompt). Each (prompt, sample) pair
is its own generation request to the batcher (which runs them together, as
it runs concurrent requests), each with its own
:class:`~.openai_compat.Shaper`; this module numbers them as vLLM does
(choice ``index = prompt index * n + sample index``), gives sample ``i`` the
seed ``seed + i`` (vLLM's rule for the children of a seeded request), and
puts the answers together: one response whose usage counts each prompt once
and every choice's tokens, or one stream. A stream sends each choice's
chunks in turn (each chunk names its choice ``index``, as in vLLM; the
choices run at the same time, but their chunks are not interleaved) and then
one usage chunk and ``[DONE]``.
"""

from __future__ import annotations

import contextlib
import functools

from starlette.responses import JSONResponse, StreamingResponse

from ..jobs import errors
from . import openai_compat, receipts
from ..scheduling.batcher import BatcherFull
from .openai_compat import DONE, EXT

__all__ = ["drain", "respond", "response", "seed_for", "shaper", "stream"]


def shaper(server, req, prompt, n, length, extension, receipt=None, n_edits=0, ids=None):
    """The :class:`~.openai_compat.Shaper` of one choice of ``server``'s answer to ``req`` (``prompt``: its prompt,
    ``n``: its token limit, ``length``: the prompt's tokens; ``extension``: the request has an intervention);
    with a ``receipt``, a :class:`~.receipts.ReceiptShaper` (``n_edits``: the model name's edits ran first);
    ``ids``: the prompt's token ids as the server tokenized them (so an echo does not tokenize it again)."""
    tok = server.model.tokenizer
    args = (req, n, length, server.front.eos_ids(), extension, server.prompt_tokens_details, tok)
    out = openai_compat.Shaper(*args) if receipt is None else \
        receipts.ReceiptShaper(*args, receipt=receipt, n_edits=n_edits)
    if req.logprobs.echo:   # vLLM echoes a prompt's own text, or the text of its token ids
        out.prompt_text = prompt if isinstance(prompt, str) else tok.decode(prompt)
        out.prompt_ids = list(ids) if ids is not None else list(tok(prompt)["input_ids"]) if isinstance(prompt, str) \
            else list(prompt)
    return out


async def respond(server, request, fields, req, inputs, fns, make_shaper, scope, options):
    """``server``'s answer with several choices: ``inputs`` are the checked ``(prompt, input, length, max new
    tokens)`` of each prompt, ``fns`` the interventions (the model name's edits first), ``make_shaper(prompt, n,
    length, generate)`` a choice's shaper, ``scope`` the prefix-cache scope of the model name's edits,
    ``options`` the generation keywords of every choice."""
    shapers, streams = [], []
    try:
        for p, (prompt, x, length, n) in enumerate(inputs):
            ids = x
            x = server.front.generation_input(x, req.cache_salt, scope)
            for sample in range(req.n):
                sh = make_shaper(prompt, n, length, seed_for(req.generate, sample), ids)
                sh.index, sh.prompt_key = len(shapers), p
                streams.append(server.batcher.stream_generate(x, *fns, max_new_tokens=n,
                                                              receipt=getattr(sh, "receipt", None),
                                                              **{**seed_for(req.generate, sample), **options}))
                shapers.append(sh)
    except BatcherFull as exc:
        for events in streams:
            await events.aclose()
        raise errors.failure(exc) from None
    fields["choices"] = len(shapers)
    if not req.stream:
        return await server.respond(request, fields, functools.partial(drain, streams),
                                     lambda results: JSONResponse(response(shapers, results)))
    fields["stream"] = True
    bodies = []
    for sh, events in zip(shapers, streams):
        def stream_error(fail, sh=sh):
            server.metrics.failed(fail.kind)     # the answer's status was 200; its failure still counts
            return sh.error(openai_compat.error_body(fail.status, fail.error, fail.param))
        bodies.append(server.stream_events(events, sh.event, stream_error, end_on_error=True))

    async def body():
        async with contextlib.aclosing(stream(shapers, bodies)) as chunks:
            async for chunk in chunks:
                yield chunk
    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def seed_for(generate: dict, sample: int) -> dict:
    """The generation keywords of sample ``sample`` of a prompt: a seeded request's seed plus ``sample``."""
    if sample and generate.get("seed") is not None:
        return dict(generate, seed=generate["seed"] + sample)
    return generate


async def drain(streams) -> list:
    """Every stream's result (its ``done`` event), in order; the first failure cancels the others and is raised."""
    results = []
    try:
        for events in streams:
            result = None
            async for ev in events:
                if ev.get("event") == "done":
                    result = ev["result"]
            results.append(result)
    finally:
        for events in streams:
            await events.aclose()
    return results


def _usage(shapers, results) -> dict:
    prompts = {}
    completion = 0
    for sh, g in zip(shapers, results):
        prompts.setdefault(sh.prompt_key, sh.prompt_tokens)
        completion += len(sh.answer_tokens(g.tokens)[0])
    prompt = sum(prompts.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def response(shapers, results) -> dict:
    """The non-streaming answer of several choices."""
    first = shapers[0]
    out = {"id": first.id, "object": first.object, "created": first.created, "model": first.req.model,
           "choices": [sh.choice(g) for sh, g in zip(shapers, results)], "usage": _usage(shapers, results)}
    if first.extension:
        out[EXT] = {"choices": [sh.ext(g) for sh, g in zip(shapers, results)]}
    return out


async def stream(shapers, bodies):
    """The stream of several choices: ``bodies[i]`` is choice ``i``'s chunks (an async iterator); each shaper
    sends neither usage nor ``[DONE]`` itself. Ends early (after the failing choice's error) when one fails."""
    first = shapers[0]
    for sh in shapers:
        sh.tail = False
        sh.id, sh.created = first.id, first.created
    try:
        for sh, body in zip(shapers, bodies):
            yield sh.start()
            async for chunk in body:
                yield chunk
                if chunk.endswith(DONE):      # an error ended this choice: the answer ends with it
                    return
        if first.req.include_usage and all(sh.final is not None for sh in shapers):
            yield first._chunk([], usage=_usage(shapers, [sh.final for sh in shapers]))
        yield DONE
    finally:
        for body in bodies:
            await body.aclose()
