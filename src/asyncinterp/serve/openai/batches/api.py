"""OpenAI's Batch API: ``POST /v1/batches``, ``GET /v1/batches[/{id}]``, ``POST /v1/batches/{id}/cancel``.

Why this module exists: evaluation tools already speak OpenAI's Batch API
(``client.batches.create(input_file_id=..., endpoint=..., completion_window="24h")``,
then ``batches.retrieve`` until ``completed``, then ``files.content`` of its
``output_file_id``). A batch here is a kept job of kind ``batch`` (:mod:`...jobs.durable`):
accepted means stored, it runs in the background (:mod:`.runner`), survives
restarts (and, on PostgreSQL, the loss of the replica running it), counts
against its key's job quotas, and belongs to the API key that created it
(another key gets 404; an admin key lists everyone's).

The batch object, its statuses (``validating`` → ``in_progress`` →
``finalizing`` → ``completed``; ``failed``; ``cancelling`` → ``cancelled``;
``expired``), ``request_counts`` and timestamps are OpenAI's; its
``asyncinterp`` field names the kept job and its restarts. Differences are
listed in docs/jobs.md ("The batch API against OpenAI's").
"""

from __future__ import annotations

import json
import re
import time

from starlette.responses import JSONResponse
from starlette.routing import Route

from ....client import wire
from ...jobs.durable import quotas as quota_checks
from ...jobs.durable.kinds import register_kind
from ...jobs.durable.store import NewJob
from ...jobs.errors import RequestFailed
from .access import caller, is_admin, not_found, openai_error, service, tables
from .files import get as get_file, new_id, page, read as read_file
from .lines import ENDPOINTS
from .runner import run_batch

__all__ = ["cancel", "create", "public", "retrieve", "routes"]

_WINDOW = re.compile(r"^([1-9][0-9]{0,5})([smh])$")
_UNIT = {"s": 1, "m": 60, "h": 3600}
MAX_METADATA = 16            # OpenAI's: 16 pairs, keys up to 64 characters, values up to 512
STATUSES = ("validating", "in_progress", "finalizing", "expiring", "cancelling", "completed", "failed", "cancelled",
            "expired")
ENDED = ("completed", "failed", "cancelled", "expired")
JOB_SLACK_S = 600.0          # a batch's kept job may outlive its window by this much (writing its files)


def _bad(message, param=None):
    return RequestFailed("request", message, param=param)


def window_seconds(value) -> int:
    """``completion_window`` in seconds: OpenAI's ``"24h"``, or any ``N[smh]`` up to it."""
    m = _WINDOW.match(value) if isinstance(value, str) else None
    seconds = int(m.group(1)) * _UNIT[m.group(2)] if m else 0
    if not m or seconds > 24 * 3600:
        raise _bad(f"completion_window must be '24h' (or a shorter 'N[smh]'), got {str(value)[:20]!r}",
                   "completion_window")
    return seconds


def _metadata(value):
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_METADATA or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in value.items()):
        raise _bad(f"metadata takes at most {MAX_METADATA} string pairs (keys up to 64 characters, values up to "
                   "512)", "metadata")
    return value


def public(record: dict) -> dict:
    """A batch record as OpenAI shows it: its owner stays on the server; an expiring batch (writing its files)
    shows as finalizing."""
    out = {k: v for k, v in record.items() if k != "owner"}
    if out["status"] == "expiring":
        out["status"] = "finalizing"
    return out


async def create(server, owner: str, obj: dict) -> dict:
    """Accept a batch: checked, its input copied, kept with its job (429 over the key's job quotas)."""
    extra = sorted(set(obj) - {"input_file_id", "endpoint", "completion_window", "metadata"})
    if extra:
        raise _bad(f"unknown field(s) {extra}; a batch takes input_file_id, endpoint, completion_window, metadata",
                   extra[0])
    endpoint = obj.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise _bad(f"endpoint must be one of {sorted(ENDPOINTS)} on this server, got {str(endpoint)[:80]!r}",
                   "endpoint")
    window = window_seconds(obj.get("completion_window"))
    metadata = _metadata(obj.get("metadata"))
    durable, db = service(server), tables(server)
    source = await get_file(db, owner, obj.get("input_file_id"))
    if source["purpose"] != "batch":
        raise _bad(f"the file {source['id']!r} has purpose {source['purpose']!r}; upload the requests with purpose "
                   "'batch'", "input_file_id")
    await quota_checks.check(durable.store, owner, durable.config.quotas)
    now = int(time.time())
    record = {"id": new_id("batch_"), "object": "batch", "endpoint": endpoint, "errors": None,
              "input_file_id": source["id"], "completion_window": obj["completion_window"], "status": "validating",
              "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
              "expires_at": now + window, "finalizing_at": None, "completed_at": None, "failed_at": None,
              "expired_at": None, "cancelling_at": None, "cancelled_at": None,
              "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata, "model": None,
              "usage": None, "owner": owner}
    await db.add_batch(record, await read_file(db, owner, source["id"]))      # the batch keeps its own copy
    jid = await durable.store.submit(NewJob(owner, "batch", wire.packb({"batch": record["id"]}),
                                            window + JOB_SLACK_S, meta={"label": f"batch {record['id']}"}))
    record = await db.update_batch(record["id"], job_id=jid)
    durable.runner.wake.set()
    return dict(record, asyncinterp={"job": jid, "restarts": 0})


async def retrieve(server, owner: str | None, bid) -> dict:
    """The batch as OpenAI shows it, with live ``request_counts`` while it runs (``owner=None``: an admin)."""
    db = tables(server)
    record = await db.batch(bid, owner) if isinstance(bid, str) else None
    if record is None:
        raise not_found("batch", bid)
    if record["status"] in ("in_progress", "finalizing", "cancelling", "expiring"):
        ok, failed = await db.counts(record["id"])
        record["request_counts"] = dict(record["request_counts"], completed=ok, failed=failed)
    jid = record["asyncinterp"].get("job")
    row = await service(server).store.get(jid, None) if jid else None
    if row is not None and row["state"] in ("failed", "cancelled") and record["status"] not in ENDED:
        record = await _ended_with_its_job(db, record, row)
    record["asyncinterp"]["restarts"] = len((row or {}).get("restarts") or [])
    return public(record)


async def _ended_with_its_job(db, record, row) -> dict:
    """A batch whose kept job ended without finishing it (its runs kept dying: ``JobLost``; the job deleted with
    ``DELETE /v1/jobs/ID``) ends too: ``failed`` (or ``cancelled``), saying why."""
    error = row.get("error") or {}
    now = int(time.time())
    if row["state"] == "cancelled":
        changes = {"status": "cancelled", "cancelled_at": now}
    else:
        changes = {"status": "failed", "failed_at": now, "errors": {"object": "list", "data": [
            {"code": "batch_job_failed", "line": None, "param": None,
             "message": f"the batch's job {row['id']} failed: {error.get('type')}: {error.get('message')}"}]}}
    changed = await db.update_batch(record["id"], only_if=tuple(s for s in STATUSES if s not in ENDED), **changes)
    return dict(changed or await db.batch(record["id"]), asyncinterp=record["asyncinterp"])


async def cancel(server, owner: str, bid) -> dict:
    db = tables(server)
    record = await db.batch(bid, owner) if isinstance(bid, str) else None
    if record is None:
        raise not_found("batch", bid)
    changed = await db.update_batch(record["id"], only_if=("validating", "in_progress"), status="cancelling",
                                    cancelling_at=int(time.time()))
    if changed is None:
        now = await db.batch(record["id"])
        if now["status"] not in ("cancelling", "cancelled"):
            raise RequestFailed("conflict", f"the batch is {now['status']}; only a validating or in_progress batch "
                                            "can be cancelled")
    service(server).runner.wake.set()
    return await retrieve(server, owner, record["id"])


# --------------------------------------------------------------------------- endpoints
def routes(server) -> list:
    register_kind("batch", run_batch)       # what runs a batch's kept job

    def route(path, fn, method):
        async def endpoint(request):
            async def work(fields):
                return JSONResponse(await fn(server, request, caller(server, request)))
            return await server.guarded(request, f"batches.{fn.__name__.strip('_')}", work, openai_error)
        return Route(path, endpoint, methods=[method])
    return [route("/v1/batches", _create, "POST"), route("/v1/batches", _list, "GET"),
            route("/v1/batches/{batch_id}", _retrieve, "GET"),
            route("/v1/batches/{batch_id}/cancel", _cancel, "POST")]


async def _create(server, request, owner):
    try:
        obj = json.loads(await server.read_body(request))
    except ValueError:
        raise _bad("the body must be a JSON object") from None
    if not isinstance(obj, dict):
        raise _bad("the body must be a JSON object")
    return public(await create(server, owner, obj))


async def _list(server, request, owner):
    admin = is_admin(server, request)
    records = await tables(server).list_batches(None if admin else owner)
    listed = [await retrieve(server, None, r["id"]) for r in records]
    return page(listed, request.query_params)


async def _retrieve(server, request, owner):
    return await retrieve(server, owner, request.path_params["batch_id"])


async def _cancel(server, request, owner):
    return await cancel(server, owner, request.path_params["batch_id"])
