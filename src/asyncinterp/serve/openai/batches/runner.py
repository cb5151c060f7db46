"""Runs a batch: each line answered as its synchronous request would be, every answer kept before it counts.

Why this module exists: a batch is a kept job of kind ``batch``; the kept-jobs runner
(:mod:`...jobs.durable.runner`) claims it, holds its lease, and after a restart (or, on PostgreSQL, the loss of
the replica that ran it) runs it again. Each run takes the batch from wherever the last one stopped:

* **validating**: the input file's lines are checked (:mod:`.lines`); a bad line fails the batch with
  OpenAI's ``errors`` list;
* **in_progress**: the lines without an answer run concurrently (at most the batcher's ``max_batch`` at
  a time, so they share forward passes with each other and leave room for interactive requests), each
  through the server's own OpenAI handler (``Server.openai_work``) as if it had arrived as ``POST url``:
  the same checks, model names, edits, logprobs, extension field and errors, hence the same answer.
  Each answer is inserted into the batch's lines table, keyed by its line, before it counts: a line
  whose answer is not there when the server dies runs again in the next run, and a line is never
  answered twice (a second insert is refused by the key);
* **finalizing**: the output and error files are written (in input order), the batch's ``usage`` (the
  answered lines' tokens, summed) is set, then the batch is ``completed``; cancelled and expired batches
  keep what was answered, and their unanswered lines go to the error file (``batch_cancelled``,
  ``batch_expired``). The batch's ``model`` is set when it starts (the model its lines name).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
import uuid

from starlette.requests import Request

from .... import aio
from ....client import wire
from ...jobs.errors import RequestFailed
from .. import openai_compat
from .access import service, tables
from .files import create as create_file
from .lines import ENDPOINTS, answer_line, parse_lines, skipped_line

log = logging.getLogger("asyncinterp.serve")

ACTIVE = ("finalizing", "cancelling", "expiring")   # ends to write (expiring: shown as in_progress meanwhile)
RETRY_BUSY_S = 0.25          # a full queue: the line waits and tries again (it is not an error of the line)
TICK_S = 0.5                 # how often a running batch looks at its cancel flag and its deadline


async def answer(server, path: str, body: bytes) -> tuple:
    """``(status, JSON body, request id)``: what ``server`` answers to ``POST path`` with ``body``, as an
    OpenAI request (only the API key check is not repeated: the batch's owner was checked when it was made)."""
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()      # no disconnect: the line is answered, or cancelled with its batch

    scope = {"type": "http", "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "root_path": "", "query_string": b"", "client": None, "server": None,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    request_id = "req_" + uuid.uuid4().hex
    fields = {}
    if _streams(body):
        fail = RequestFailed("request", "stream=true is not supported in a batch: its answers go to the output "
                                        "file", param="stream")
        return fail.status, openai_compat.error_body(fail.status, fail.error, fail.param), request_id
    arrivals = getattr(server.batcher, "arrivals", None)
    while True:
        try:
            # on its way to the front, as an HTTP request is: a forward that starts meanwhile may wait for it
            with arrivals.expect() if arrivals is not None else contextlib.nullcontext():
                response = await server.openai_work(Request(scope, receive), ENDPOINTS[path], fields)
            return response.status_code, json.loads(response.body), request_id
        except RequestFailed as fail:
            if fail.kind == "overloaded":
                await asyncio.sleep(RETRY_BUSY_S)
                sent = False
                continue
            if fail.kind == "closed":          # the server is shutting down: the line runs after the restart
                raise asyncio.CancelledError("the server is closing") from None
            return fail.status, openai_compat.error_body(fail.status, fail.error, fail.param), request_id
        except Exception as exc:  # noqa: BLE001 - a line's failure is its own answer, never the batch's
            log.exception("batch line failed", extra={"fields": {"request_id": request_id}})
            fail = RequestFailed("internal", f"internal server error ({type(exc).__name__})")
            return fail.status, openai_compat.error_body(fail.status, fail.error), request_id


async def run_batch(server, body: bytes, timeout: float, progress) -> dict:
    """The kept job of a batch (kind ``batch``, :mod:`...jobs.durable.kinds`): drive it to its end, from wherever
    an earlier run stopped. Its answer names the batch and its final status."""
    bid = wire.unpackb(body)["batch"]
    db = tables(server)
    try:
        return await _run(server, db, bid, progress)
    except Exception as exc:   # the batch fails with the reason (its kept job fails too, with the error)
        log.exception("batch failed", extra={"fields": {"event": "batch", "batch": bid}})
        await db.update_batch(bid, only_if=("validating", "in_progress", "finalizing", "expiring", "cancelling"),
                              status="failed", failed_at=int(time.time()),
                              errors={"object": "list", "data": [{"code": "server_error", "line": None, "param": None,
                                                                  "message": f"{type(exc).__name__}: {exc}"}]})
        raise


async def _run(server, db, bid, progress) -> dict:
    record = await db.batch(bid)
    if record is None:
        raise RequestFailed("not_found", f"the batch {bid!r} no longer exists")
    data = await db.batch_input(bid)
    lines, errors = await aio.to_thread(parse_lines, data, record["endpoint"])
    if record["status"] == "validating":
        if errors:
            await db.update_batch(bid, status="failed", failed_at=int(time.time()),
                                  errors={"object": "list", "data": errors})
            return {"ok": True, "result": {"batch": bid, "status": "failed"}}
        record = await db.update_batch(bid, only_if=("validating",), status="in_progress",
                                       in_progress_at=int(time.time()), model=model_of(lines),
                                       request_counts={"total": len(lines), "completed": 0, "failed": 0}) \
            or await db.batch(bid)
    if record["status"] == "in_progress":
        record = await _answer(server, db, record, lines, progress)
    if record["status"] in ACTIVE:
        record = await _finish(db, record, lines, service(server).config.file_ttl)
    return {"ok": True, "result": {"batch": bid, "status": record["status"]}}


async def _answer(server, db, record, lines, progress) -> dict:
    """Answer the lines that have no answer yet, at most ``max_batch`` at a time, until all are answered, the
    batch is cancelled, or its window ends; the record after it (``finalizing``, ``cancelling``, ``expiring``)."""
    bid = record["id"]
    done = set(await db.answered(bid))
    counts = dict(zip(("completed", "failed"), await db.counts(bid)))
    slots = asyncio.Semaphore(max(1, server.batcher.max_batch))
    path = record["endpoint"]

    async def one(line):
        async with slots:
            status, body, request_id = await answer(server, path, line.body)
            if await db.add_line(bid, line.index, status == 200, answer_line(line, status, body, request_id)):
                counts["completed" if status == 200 else "failed"] += 1
                progress({"phase": "in_progress", "completed": counts["completed"], "failed": counts["failed"],
                          "of": len(lines)})

    tasks = {asyncio.get_running_loop().create_task(one(line)) for line in lines if line.index not in done}
    status = "in_progress"
    try:
        while tasks:
            finished, tasks = await asyncio.wait(tasks, timeout=TICK_S)
            for t in finished:
                t.result()           # a failure of the runner itself (a line's own failure is its answer)
            status = (await db.batch(bid))["status"]        # cancelled meanwhile (on any replica)?
            if status != "in_progress" or time.time() >= record["expires_at"]:
                break
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if status == "cancelling":
        return await db.batch(bid)
    end = {"status": "finalizing", "finalizing_at": int(time.time())} if not tasks else {"status": "expiring"}
    return await db.update_batch(bid, only_if=("in_progress",), **end) or await db.batch(bid)


async def _finish(db, record, lines, file_ttl) -> dict:
    """Write the output and error files (input order, kept ``file_ttl`` seconds) and end the batch: completed,
    cancelled or expired."""
    bid, status = record["id"], record["status"]
    answered = await db.answered(bid)
    skipped = {"cancelling": ("batch_cancelled", "the batch was cancelled before this request ran"),
               "expiring": ("batch_expired", "this request could not be executed before the completion window "
                                             "expired")}.get(status)
    if skipped is not None:
        for line in lines:
            if line.index not in answered:
                answered[line.index] = (False, skipped_line(line, *skipped))
    out = [answered[i][1] for i in sorted(answered) if answered[i][0]]
    err = [answered[i][1] for i in sorted(answered) if not answered[i][0]]
    files = {}
    for field, entries, tag in (("output_file_id", out, "output"), ("error_file_id", err, "errors")):
        files[field] = None
        if entries:       # an id derived from the batch's: written again after a crash, it replaces itself
            fid = "file-" + hashlib.sha256(f"{bid}/{tag}".encode()).hexdigest()[:32]
            data = b"".join(json.dumps(e, separators=(",", ":")).encode() + b"\n" for e in entries)
            await create_file(db, record["owner"], f"{bid}_{tag}.jsonl", "batch_output", data, fid=fid, ttl=file_ttl)
            files[field] = fid
    final, stamp = {"finalizing": ("completed", "completed_at"), "cancelling": ("cancelled", "cancelled_at"),
                    "expiring": ("expired", "expired_at")}.get(status, ("completed", "completed_at"))
    counts = {"total": len(lines), "completed": len(out), "failed": len(err)}
    record = await db.update_batch(bid, status=final, request_counts=counts, usage=usage_of(out),
                                   **{stamp: int(time.time())}, **files)
    await db.drop_lines(bid)
    log.info("batch ended", extra={"fields": {"event": "batch", "batch": bid, "status": final, **counts}})
    return record


def model_of(lines) -> str | None:
    """The batch's ``model`` (OpenAI's field): the model its lines name; the names in order of first use,
    comma-separated, when its lines name several (OpenAI's batches have one)."""
    names = []
    for line in lines:
        try:
            name = json.loads(line.body).get("model")
        except (ValueError, AttributeError):
            continue
        if isinstance(name, str) and name not in names:
            names.append(name)
    return ",".join(names) or None


def usage_of(answers) -> dict:
    """OpenAI's batch ``usage``: the tokens of the answered lines (their answers' ``usage``), summed."""
    total = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0, "cached": 0}
    for answer in answers:
        usage = ((answer.get("response") or {}).get("body") or {}).get("usage") or {}
        total["input_tokens"] += int(usage.get("prompt_tokens") or 0)
        total["output_tokens"] += int(usage.get("completion_tokens") or 0)
        total["total_tokens"] += int(usage.get("total_tokens") or 0)
        total["cached"] += int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {"input_tokens": total["input_tokens"], "input_tokens_details": {"cached_tokens": total["cached"]},
            "output_tokens": total["output_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": total["total_tokens"]}


def _streams(body: bytes) -> bool:
    try:
        return json.loads(body).get("stream") is True
    except (ValueError, AttributeError):
        return False
