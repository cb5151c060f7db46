"""What runs a kept job, by kind: the same code as the blocking request of that kind.

Why: a job submitted without waiting must give exactly what the blocking request gives (the same
checks, sandbox, batching, answer), so each kind here calls the code of its endpoint:

* ``trace`` and ``generate``: a whole job (:mod:`..jobs_api`: ``POST /v1/jobs``), run as one group of
  the batcher (or of the worker processes of a supervised server), streamed so that a generation's
  tokens become its progress; the answer is ``{"ok": true, "results": [...]}``;
* ``session``: a captured ``async def session(model)`` (:mod:`..sessions`); the answer is
  ``{"ok": true, "result": value}``.

Each kind reports its progress (``progress(dict)``; shown as the status' ``progress``), always with a
``phase``:

* trace: ``{"phase": "loading"}`` (its code rebuilt through the sandbox), then ``{"phase": "forward",
  "invokes": n}`` (in the batcher: waiting for, or in, its forward pass);
* generation: ``loading``, ``forward``, then ``{"phase": "generating", "step", "of", "invokes"}`` at
  every token (``step``: tokens every invoke has, ``of``: ``max_new_tokens``);
* session: ``loading``, then ``{"phase": "running", "traces", "generations", "done"}`` (its traces and
  generations finished so far: a session's code decides how many there will be); on a server whose
  code runs in worker processes only ``{"phase": "running"}``;
* batch (:mod:`...openai.batches.runner`): ``{"phase": "in_progress", "completed", "failed", "of"}``.

A runner is ``async def run(server, body, timeout, progress) -> answer``; it raises as the endpoint
would (the error map and status are the endpoint's, :mod:`..errors`). :func:`register_kind` adds one
(e.g. a batch of OpenAI requests). Each run starts from the job's wire form, so a job run again after
its server died starts from its start.
"""

from __future__ import annotations

import time

from .... import aio
from ....client import wire
from .. import jobs_api
from ..errors import RequestFailed
from ...sandbox.rebuild_sandbox import Sandboxed
from ...scheduling.requests import Meter
from ...scheduling.submission import Envelope
from ..sessions import load_session

__all__ = ["KINDS", "register_kind", "job_kind"]


def job_kind(obj) -> str:
    """The kind of a submitted body (``POST /v1/jobs``: from its job; ``POST /v1/sessions``: ``session``)."""
    if "session" in obj:
        return "session"
    body = wire.unpackb(obj["job"], wire.answer_limits(len(obj["job"]))) if isinstance(obj.get("job"), bytes) else {}
    kind = body.get("kind", "trace") if isinstance(body, dict) else "trace"
    return kind if kind in ("trace", "generate") else "trace"


async def run_job(server, body: bytes, timeout: float, progress) -> dict:
    progress({"phase": "loading"})
    obj = server.decode_body(body)
    data = obj["job"]
    if server.supervised:   # the worker that runs it reads and checks it (jobs_api.begin_in_worker)
        outline = jobs_api.outline_of(server, data)
        kind, invokes = outline.kind, outline.invokes
        total = outline.generation.get("max_new_tokens", jobs_api.DEFAULT_NEW_TOKENS) if kind == "generate" else None
        events = server.batcher.stream_job(data, code=outline.code, timeout=timeout)
        encode = None
    else:
        sandbox = Sandboxed(time.monotonic() + timeout, min(server.code_budget, timeout), server.model) \
            if server.allow_code else None
        job = await jobs_api.load_job_async(server, data, sandbox, timeout)
        checked = jobs_api.checked_job(server, job)
        kind, invokes = job.kind, len(checked.invokes)
        total = checked.generation.get("max_new_tokens")
        meter, on_cancel = Meter(), None
        if sandbox is not None:
            meter = sandbox.clock

            def on_cancel():
                sandbox.clock.cancelled = True
        sub = server.batcher.start(checked, Envelope(None, meter, timeout, None, on_cancel), stream=True)
        events = server.batcher.events(sub)
        encode = kind
    steps = {}
    progress({"phase": "forward", "invokes": invokes})
    try:
        async for ev in events:
            if ev["event"] == "done":
                if encode is None:   # a worker process's results, as it encoded them (jobs_api.begin_in_worker)
                    results = wire.unpackb(ev["result"], wire.answer_limits(len(ev["result"])))
                else:
                    results = jobs_api.outcomes_of(encode, ev["result"])
                return {"ok": True, "results": results}
            if ev["event"] == "token":
                steps[ev.get("invoke", 0)] = ev.get("step", 0) + 1
                progress({"phase": "generating", "step": min(steps.values()), "of": total,
                          "invokes": invokes})
    finally:
        await events.aclose()
    raise RequestFailed("internal", "the job's stream ended without its answer")


async def run_session(server, body: bytes, timeout: float, progress) -> dict:
    if not server.allow_code:
        raise RequestFailed("refused", "this server does not accept submitted code (start it with --allow-code), "
                                       "so it runs no sessions")
    progress({"phase": "loading"})
    obj = server.decode_body(body)
    done = {"phase": "running", "traces": 0, "generations": 0, "done": 0}

    def finished(what):           # a trace or generation of the session finished (on the event loop)
        done[what] += 1
        done["done"] += 1
        progress(dict(done))
    run = await aio.to_thread(load_session, server, obj, server.batcher, timeout, server.supervised, finished)
    if server.supervised:         # its worker process runs it: no count from there
        progress({"phase": "running"})
        value = await server.batcher.session(obj, timeout)
    else:
        progress(dict(done))
        value = await run()
    return {"ok": True, "result": value}


KINDS = {"trace": run_job, "generate": run_job, "session": run_session}


def register_kind(kind: str, run) -> None:
    """Run kept jobs of ``kind`` with ``run(server, body, timeout, progress)`` (an ``async def``)."""
    if kind in KINDS and KINDS[kind] is not run:
        raise ValueError(f"a job kind {kind!r} is already registered")
    KINDS[kind] = run
