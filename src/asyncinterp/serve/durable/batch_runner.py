"""Runs batches: each line answered as its synchronous request would be, every answer kept before it counts.

Why this module exists: a batch is a job that outlives its request. The
runner is one asyncio task of the server (started with the app, see
:class:`~.state.Durable`). It takes every batch that is not finished
(``validating``, ``in_progress``, ``finalizing``, ``cancelling``) from the
store, also after a restart, and drives it to its end:

* **validating**: the input file's lines are checked (:mod:`.batch_lines`);
  a bad line fails the batch with OpenAI's ``errors`` list;
* **in_progress**: the lines not yet answered run concurrently (at most the
  batcher's ``max_batch`` at a time, so they share forward passes with each
  other and leave room for interactive requests), each through the server's
  own OpenAI handler (``Server.openai_work``) as if it had arrived as
  ``POST url``: the same checks, model names, edits, logprobs, extension
  field and errors, hence the same answer. Each answer is appended to the
  batch's answer log and flushed to disk before it counts; a line whose
  answer is not in the log when the server dies runs again after the
  restart, so no line is lost and none is answered twice;
* **finalizing**: the output and error files are written (in input order),
  then the batch is ``completed``; cancelled and expired batches keep what
  was answered, and their unanswered lines go to the error file
  (``batch_cancelled``, ``batch_expired``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from starlette.requests import Request

from ... import aio
from .. import openai_compat
from ..errors import RequestFailed
from .batch_lines import ENDPOINTS, answer_line, parse_lines, skipped_line
from .records import AppendLog

log = logging.getLogger("asyncinterp.serve")

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling", "expiring")   # expiring: shown as finalizing
RETRY_BUSY_S = 0.25          # a full queue: the line waits and tries again (it is not an error of the line)
TICK_S = 0.5                 # how often a running batch looks at its cancel flag and its deadline
SAVE_EVERY_S = 0.5           # how often a running batch's request_counts are written to its record


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
    while True:
        try:
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


class BatchRunner:
    """Drives every unfinished batch of ``batches`` (a :class:`~.batches.Batches`) on ``server``."""

    def __init__(self, server, batches):
        self.server = server
        self.batches = batches
        self.running: dict[str, asyncio.Task] = {}
        self.cancel_flags: dict[str, asyncio.Event] = {}
        self.live_counts: dict[str, dict] = {}
        self.wake = None
        self.task = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start (once, inside the server's event loop); batches left unfinished by a previous process resume."""
        if self.task is not None:
            return
        self.wake = asyncio.Event()
        for record in self.batches.store.all():
            if record["status"] in ACTIVE:
                ext = record.setdefault("asyncinterp", {})
                ext["resumed"] = ext.get("resumed", 0) + 1
                self.batches.store.put(record["id"], record)
                log.info("batch resumed", extra={"fields": {"event": "batch", "batch": record["id"],
                                                            "status": record["status"]}})
        self.task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        tasks = [t for t in (self.task, *self.running.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.task = None

    def poke(self, batch_id: str | None = None, cancel: bool = False) -> None:
        if cancel and batch_id in self.cancel_flags:
            self.cancel_flags[batch_id].set()
        if self.wake is not None:
            self.wake.set()

    async def _loop(self) -> None:
        while True:
            for record in self.batches.store.all():
                bid = record["id"]
                if record["status"] in ACTIVE and bid not in self.running:
                    self.cancel_flags[bid] = asyncio.Event()
                    if record["status"] == "cancelling":
                        self.cancel_flags[bid].set()
                    self.running[bid] = asyncio.get_running_loop().create_task(self._guard(bid))
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), 5.0)
            except asyncio.TimeoutError:
                pass

    async def _guard(self, bid: str) -> None:
        try:
            await self._run(bid)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a batch that cannot go on fails loudly, with the reason
            log.exception("batch failed", extra={"fields": {"event": "batch", "batch": bid}})
            self.batches.update(bid, status="failed", failed_at=int(time.time()),
                                errors={"object": "list", "data": [{"code": "server_error", "line": None,
                                                                    "param": None,
                                                                    "message": f"{type(exc).__name__}: {exc}"}]})
        finally:
            self.running.pop(bid, None)
            self.cancel_flags.pop(bid, None)
            self.live_counts.pop(bid, None)

    # ------------------------------------------------------------------ one batch
    async def _run(self, bid: str) -> None:
        record = self.batches.store.get(bid)
        data = await aio.to_thread(_read, self.batches.store.blob_path(bid, ".input"))
        lines, errors = parse_lines(data, record["endpoint"])
        if record["status"] == "validating":
            if errors:
                self.batches.update(bid, status="failed", failed_at=int(time.time()),
                                    errors={"object": "list", "data": errors})
                return
            record = self.batches.update(bid, status="in_progress", in_progress_at=int(time.time()),
                                         request_counts={"total": len(lines), "completed": 0, "failed": 0})
        logs = [AppendLog(self.batches.store.blob_path(bid, suffix)) for suffix in (".out.jsonl", ".err.jsonl")]
        try:
            if record["status"] == "in_progress":
                await self._answer(bid, record, lines, logs)
                record = self.batches.store.get(bid)
            await self._finish(bid, record, lines, logs)
        finally:
            for lg in logs:
                lg.close()
        if self.batches.store.get(bid)["status"] not in ACTIVE:      # the files hold the answers now
            self.batches.store.delete(bid, ".out.jsonl", ".err.jsonl", ".input", only_blobs=True)

    async def _answer(self, bid, record, lines, logs) -> None:
        out, err = logs
        done = {e["i"] for lg in logs for e in lg.entries}
        counts = {"total": len(lines), "completed": len(out.entries), "failed": len(err.entries)}
        self.live_counts[bid] = counts
        lock = asyncio.Lock()
        slots = asyncio.Semaphore(max(1, self.server.batcher.max_batch))
        path = record["endpoint"]

        async def one(line):
            async with slots:
                status, body, request_id = await answer(self.server, path, line.body)
                async with lock:        # one writer at a time, in a thread: the event loop does not wait on disk
                    target = out if status == 200 else err
                    await aio.to_thread(target.append, {"i": line.index,
                                                        "line": answer_line(line, status, body, request_id)})
                    counts["completed" if status == 200 else "failed"] += 1

        tasks = {asyncio.get_running_loop().create_task(one(line)) for line in lines if line.index not in done}
        flag = self.cancel_flags[bid]
        saved = time.monotonic()
        try:
            while tasks:
                finished, tasks = await asyncio.wait(tasks, timeout=TICK_S)
                for t in finished:
                    t.result()           # a failure of the runner itself (a line's own failure is its answer)
                if flag.is_set() or time.time() >= record["expires_at"]:
                    break
                if time.monotonic() - saved > SAVE_EVERY_S:
                    self.batches.update(bid, request_counts=dict(counts))
                    saved = time.monotonic()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        changes = {"request_counts": dict(counts)}
        if not tasks:
            changes.update(status="finalizing", finalizing_at=int(time.time()))
        elif flag.is_set():
            changes["status"] = "cancelling"     # already so when cancelled through the API
        else:
            changes["status"] = "expiring"       # internal: written out as expired by _finish
        self.batches.update(bid, **changes)

    async def _finish(self, bid, record, lines, logs) -> None:
        out, err = logs
        status = record["status"]
        done = {e["i"] for lg in logs for e in lg.entries}
        skipped = {"cancelling": ("batch_cancelled", "the batch was cancelled before this request ran"),
                   "expiring": ("batch_expired", "this request could not be executed before the completion "
                                                 "window expired")}.get(status)
        if skipped is not None:
            for line in lines:
                if line.index not in done:
                    await aio.to_thread(err.append, {"i": line.index, "line": skipped_line(line, *skipped)})
        counts = {"total": len(lines), "completed": len(out.entries), "failed": len(err.entries)}
        files = await aio.to_thread(self.batches.write_outputs, bid, record["owner"], out.entries, err.entries)
        end = {"finalizing": ("completed", "completed_at"), "cancelling": ("cancelled", "cancelled_at"),
               "expiring": ("expired", "expired_at")}[status]
        self.batches.update(bid, status=end[0], **{end[1]: int(time.time())}, request_counts=counts, **files)
        log.info("batch ended", extra={"fields": {"event": "batch", "batch": bid, "status": end[0], **counts}})


def _streams(body: bytes) -> bool:
    try:
        return json.loads(body).get("stream") is True
    except (ValueError, AttributeError):
        return False


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
