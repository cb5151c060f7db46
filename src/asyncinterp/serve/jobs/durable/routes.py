"""The REST endpoints of kept jobs: status, result, cancel or delete, the caller's list, a progress stream.

* ``GET /v1/jobs?limit=N&after=CURSOR&state=S`` — the caller's jobs, newest first, paged (``next`` is the
  cursor of the next page); an admin key (``--admin-key``) lists everyone's;
* ``GET /v1/jobs/{id}`` — the job's status (:mod:`.status`);
* ``GET /v1/jobs/{id}/result`` — msgpack: exactly what the blocking request would have answered (``409``
  ``JobNotFinished`` while it has not ended; a job that failed as a whole answers its error and status);
* ``DELETE /v1/jobs/{id}`` — a queued job is cancelled (it never runs); a running one is stopped at its
  next hook point and ends as cancelled; a finished one is removed with its result;
* ``GET /v1/jobs/{id}/events`` — server-sent events: ``status`` whenever the state, progress or attempt
  changes, ending with the final state (or ``timeout`` after ``?timeout=`` seconds, 300 by default).
  The changes of a job this process runs are pushed as they happen (:mod:`.changes`); a job another
  replica may run (a shared PostgreSQL store) is read from the store every ``POLL_S``.

A job is visible to the key that submitted it only: for any other key (the admin's list and status
aside) it does not exist (``404``, as for an id that was never issued). Submissions are ``POST /v1/jobs``
and ``POST /v1/sessions`` with ``"wait": false`` (:mod:`.service`).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json

from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ....client import wire
from .. import errors
from ..errors import RequestFailed
from .changes import POLL_S
from .schema import FINAL, RUNNING
from .status import describe

__all__ = ["routes"]

MSGPACK = "application/msgpack"
STREAM_LIMIT = 3600.0
PUSHED_FALLBACK_S = 5.0     # a stream whose job's changes are pushed still reads the store this often


def routes(server) -> list:
    """The routes this module adds to ``server``'s app (``server.durable`` set)."""
    def bind(fn):
        return functools.partial(fn, server)
    return [Route("/v1/jobs", bind(_list), methods=["GET"]),
            Route("/v1/jobs/{job_id}", bind(_status), methods=["GET"]),
            Route("/v1/jobs/{job_id}", bind(_delete), methods=["DELETE"]),
            Route("/v1/jobs/{job_id}/result", bind(_result), methods=["GET"]),
            Route("/v1/jobs/{job_id}/events", bind(_events), methods=["GET"])]


def _json_error(fail: RequestFailed):
    return JSONResponse({"ok": False, "error": fail.error}, fail.status, fail.headers)


def _msgpack_error(fail: RequestFailed):
    return Response(wire.packb({"ok": False, "error": fail.error}), fail.status, fail.headers, media_type=MSGPACK)


def _missing(job_id) -> RequestFailed:
    return RequestFailed("not_found", f"no job {str(job_id)[:80]!r} for this API key (it never existed, expired, "
                                      "was deleted, or was submitted with another key)")


async def _row(server, request, *, admin_may: bool):
    durable = server.durable
    store = durable.ready()
    owner = None if admin_may and durable.is_admin(request) else durable.owner(request)
    row = await store.get(request.path_params["job_id"], owner)
    if row is None:
        raise _missing(request.path_params["job_id"])
    return row


async def _status(server, request):
    async def work(fields):
        row = await _row(server, request, admin_may=True)
        fields["job"] = row["id"]
        return JSONResponse(describe(row))
    return await server.guarded(request, "job_status", work, _json_error)


async def _list(server, request):
    async def work(fields):
        durable = server.durable
        store = durable.ready()
        q = request.query_params
        try:
            limit = int(q.get("limit", 20))
            before = tuple(json.loads(base64.urlsafe_b64decode(q["after"].encode()))) if q.get("after") else None
        except (ValueError, TypeError):
            raise RequestFailed("request", "limit is an integer and after the `next` cursor of a previous page")
        if not 1 <= limit <= 100 or (before is not None and len(before) != 2):
            raise RequestFailed("request", "limit must be within 1..100 (and after a `next` cursor)")
        owner = None if durable.is_admin(request) else durable.owner(request)
        rows = await store.list(owner, limit=limit, before=before, state=q.get("state"))
        nxt = None
        if len(rows) == limit:
            nxt = base64.urlsafe_b64encode(json.dumps([rows[-1]["created_at"], rows[-1]["id"]]).encode()).decode()
        return JSONResponse({"object": "list", "data": [describe(r) for r in rows], "next": nxt})
    return await server.guarded(request, "job_list", work, _json_error)


async def _delete(server, request):
    async def work(fields):
        row = await _row(server, request, admin_may=True)
        store = server.durable.store
        fields["job"] = row["id"]
        owner = None if server.durable.is_admin(request) else row["owner"]
        if row["state"] in FINAL:
            if not await store.delete(row["id"], owner):
                raise _missing(row["id"])
            return JSONResponse({"id": row["id"], "object": "job", "deleted": True, "state": row["state"]})
        state = await store.cancel(row["id"], owner)
        return JSONResponse({"id": row["id"], "object": "job", "deleted": False, "state": state,
                             "cancel_requested": state == "running"})
    return await server.guarded(request, "job_cancel", work, _json_error)


async def _result(server, request):
    async def work(fields):
        row = await _row(server, request, admin_may=False)
        fields["job"] = row["id"]
        if row["state"] not in FINAL:
            fail = RequestFailed("not_finished", f"job {row['id']} is {row['state']}: its result comes when it ends "
                                                 "(GET /v1/jobs/ID for its state)")
            fail.error["state"] = row["state"]
            raise fail
        value = await server.durable.store.result(row)
        if value is None:
            error = dict(row["error"] or {"type": "JobFailed", "message": "the job ended without a result"})
            error.setdefault("state", row["state"])
            return Response(wire.packb({"ok": False, "error": error}), row["status_code"] or errors.status_of("internal"),
                            media_type=MSGPACK)
        return Response(wire.packb(value), media_type=MSGPACK)
    return await server.guarded(request, "job_result", work, _msgpack_error)


async def _events(server, request):
    async def work(fields):
        row = await _row(server, request, admin_may=False)
        fields["job"] = row["id"]
        try:
            limit = min(float(request.query_params.get("timeout", 300)), STREAM_LIMIT)
        except ValueError:
            raise RequestFailed("request", "timeout is a number of seconds") from None
        durable = server.durable
        store, owner, jid = durable.store, row["owner"], row["id"]
        runner = durable.runner
        changes = runner.changes
        # a store only this process uses (SQLite) has its every change pushed here; a shared one (PostgreSQL,
        # replicas) is also read every POLL_S while the job is not running here: another replica may run it
        shared = store.dialect != "sqlite"

        async def stream():
            last, current = None, row
            deadline = asyncio.get_running_loop().time() + limit
            while True:
                if current is None:
                    yield _sse("error", {"error": _missing(jid).error})
                    return
                view = describe(current)
                key = (view["state"], json.dumps(view["progress"]), view["attempts"])
                if key != last:
                    last = key
                    yield _sse("status", view)
                if view["state"] in FINAL:
                    return
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    yield _sse("timeout", {"id": jid, "state": view["state"], "after": limit})
                    return
                here = jid in runner.tasks
                await changes.wait(jid, min(left, POLL_S if shared and not here else PUSHED_FALLBACK_S))
                if jid in runner.tasks and current["state"] == RUNNING and current.get("lease_owner") == runner.worker:
                    # running here: its progress comes from the runner, no read of the store
                    current = dict(current, progress=changes.progress.get(jid, current.get("progress")))
                else:
                    current = await store.get(jid, owner)
        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await server.guarded(request, "job_events", work, _json_error)


def _sse(event: str, data) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()
