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

from .openai_compat import DONE, EXT

__all__ = ["seed_for", "response", "stream", "drain"]


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
