"""OpenAI's Batch API: ``POST /v1/batches``, ``GET /v1/batches[/{id}]``, ``POST /v1/batches/{id}/cancel``.

Why this module exists: evaluation tools already speak OpenAI's Batch API
(``client.batches.create(input_file_id=..., endpoint=..., completion_window="24h")``,
then ``batches.retrieve`` until ``completed``, then ``files.content`` of its
``output_file_id``). A batch here is a job of the server like any other: it
is kept in the state directory from the moment it is accepted, runs in the
background (:mod:`.batch_runner`), survives restarts, and belongs to the API
key that created it (another key gets 404).

The batch object, its statuses (``validating`` → ``in_progress`` →
``finalizing`` → ``completed``; ``failed``; ``cancelling`` → ``cancelled``;
``expired``), ``request_counts`` and timestamps are OpenAI's. Differences
are listed in docs/jobs.md ("The batch API against OpenAI's").
"""

from __future__ import annotations

import hashlib
import json
import re
import time

from starlette.responses import JSONResponse
from starlette.routing import Route

from ... import aio
from ..errors import RequestFailed
from .access import caller, is_admin, not_found, openai_error
from .batch_lines import ENDPOINTS
from .files import page
from .records import new_id

__all__ = ["Batches", "routes"]

_WINDOW = re.compile(r"^([1-9][0-9]{0,5})([smh])$")
_UNIT = {"s": 1, "m": 60, "h": 3600}
MAX_METADATA = 16            # OpenAI's: 16 pairs, keys up to 64 characters, values up to 512


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
    """A batch record as OpenAI shows it: the owner stays on the server, internal states read as OpenAI's."""
    out = {k: v for k, v in record.items() if k != "owner"}
    if out["status"] == "expiring":
        out["status"] = "finalizing"
    return out


class Batches:
    """The batches of one server: records under ``store``, files in ``files``, run by a runner."""

    def __init__(self, store, files):
        self.store = store
        self.files = files
        self.runner = None        # a BatchRunner, set by the server's durable state

    def update(self, bid: str, **changes) -> dict:
        record = self.store.get(bid)
        record.update(changes)
        self.store.put(bid, record)
        return record

    def create(self, owner: str, obj: dict) -> dict:
        extra = sorted(set(obj) - {"input_file_id", "endpoint", "completion_window", "metadata"})
        if extra:
            raise _bad(f"unknown field(s) {extra}; a batch takes input_file_id, endpoint, completion_window, "
                       "metadata", extra[0])
        endpoint = obj.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise _bad(f"endpoint must be one of {sorted(ENDPOINTS)} on this server, got {str(endpoint)[:80]!r}",
                       "endpoint")
        window = window_seconds(obj.get("completion_window"))
        metadata = _metadata(obj.get("metadata"))
        source = self.files.get(owner, obj.get("input_file_id"))
        if source["purpose"] != "batch":
            raise _bad(f"the file {source['id']!r} has purpose {source['purpose']!r}; upload the requests with "
                       "purpose 'batch'", "input_file_id")
        bid = new_id("batch_")
        now = int(time.time())
        self.store.put_blob(bid, self.files.read(owner, source["id"]), ".input")   # the batch keeps its own copy
        record = {"id": bid, "object": "batch", "endpoint": endpoint, "errors": None,
                  "input_file_id": source["id"], "completion_window": obj["completion_window"], "status": "validating",
                  "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
                  "expires_at": now + window, "finalizing_at": None, "completed_at": None, "failed_at": None,
                  "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                  "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata, "owner": owner,
                  "asyncinterp": {"resumed": 0}}
        self.store.put(bid, record)
        return record

    def get(self, owner: str, bid, admin: bool = False) -> dict:
        record = self.store.get(bid) if isinstance(bid, str) else None
        if record is None or (record["owner"] != owner and not admin):
            raise not_found("batch", bid)
        live = self.runner.live_counts.get(record["id"]) if self.runner is not None else None
        if live is not None and record["status"] == "in_progress":
            record["request_counts"] = dict(live)
        return record

    def cancel(self, owner: str, bid) -> dict:
        record = self.get(owner, bid)
        if record["status"] in ("validating", "in_progress"):
            record = self.update(record["id"], status="cancelling", cancelling_at=int(time.time()))
        elif record["status"] not in ("cancelling", "cancelled"):
            raise RequestFailed("conflict", f"the batch is {public(record)['status']}; only a validating or "
                                            "in_progress batch can be cancelled")
        return record

    def write_outputs(self, bid: str, owner: str, out_entries, err_entries) -> dict:
        """Write the output and error files of a finished batch (ids derived from the batch's: writing them
        again after a crash replaces them with the same bytes)."""
        ids = {}
        for field, entries, tag in (("output_file_id", out_entries, "output"), ("error_file_id", err_entries,
                                                                               "errors")):
            if not entries:
                ids[field] = None
                continue
            body = b"".join(json.dumps(e["line"], separators=(",", ":")).encode() + b"\n"
                            for e in sorted(entries, key=lambda e: e["i"]))
            fid = "file-" + hashlib.sha256(f"{bid}/{tag}".encode()).hexdigest()[:32]
            self.files.create(owner, f"{bid}_{tag}.jsonl", "batch_output", body, fid=fid)
            ids[field] = fid
        return ids


# --------------------------------------------------------------------------- endpoints
def routes(server) -> list:
    def route(path, fn, method):
        async def endpoint(request):
            async def work(fields):
                return await fn(server, request, caller(server, request))
            return await server.guarded(request, f"batches.{fn.__name__.strip('_')}", work, openai_error)
        return Route(path, endpoint, methods=[method])
    return [route("/v1/batches", _create, "POST"), route("/v1/batches", _list, "GET"),
            route("/v1/batches/{batch_id}", _retrieve, "GET"),
            route("/v1/batches/{batch_id}/cancel", _cancel, "POST")]


def _batches(server) -> Batches:
    durable = server.durable
    durable.start()
    return durable.batches


async def _create(server, request, owner):
    try:
        obj = json.loads(await server.read_body(request))
    except ValueError:
        raise _bad("the body must be a JSON object") from None
    if not isinstance(obj, dict):
        raise _bad("the body must be a JSON object")
    batches = _batches(server)
    record = await aio.to_thread(batches.create, owner, obj)
    batches.runner.poke(record["id"])
    return JSONResponse(public(record))


async def _list(server, request, owner):
    admin = is_admin(server, request)
    batches = _batches(server)
    records = [public(batches.get(owner, r["id"], admin)) for r in batches.store.all()
               if r["owner"] == owner or admin]
    return JSONResponse(page(records, request.query_params))


async def _retrieve(server, request, owner):
    return JSONResponse(public(_batches(server).get(owner, request.path_params["batch_id"])))


async def _cancel(server, request, owner):
    batches = _batches(server)
    record = batches.cancel(owner, request.path_params["batch_id"])
    batches.runner.poke(record["id"], cancel=True)
    return JSONResponse(public(record))

