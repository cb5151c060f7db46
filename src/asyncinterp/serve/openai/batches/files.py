"""OpenAI's Files API, for batches: ``POST /v1/files``, ``GET /v1/files[/{id}[/content]]``, ``DELETE /v1/files/{id}``.

Why this module exists: the stock ``openai`` client runs a batch by
uploading its requests as a JSON-lines file (``files.create(file=...,
purpose="batch")``, multipart as OpenAI's), naming the file in
``batches.create``, and downloading the answers with ``files.content``.
Files are kept in the kept-jobs database (:mod:`.tables`), belong to the
API key that uploaded them (another key gets 404), and are returned byte
for byte. A batch's output and error files are files of its owner too
(purpose ``batch_output``).

An upload with purpose ``batch`` is checked at once: UTF-8 JSON lines, each
an object, at most :data:`MAX_LINES` of them (OpenAI's limit); what each
line asks for is checked when a batch uses the file (:mod:`.lines`).

Files expire: after OpenAI's ``expires_after`` (``{"anchor": "created_at",
"seconds": S}``, S within OpenAI's 1 hour to 30 days) when the upload names
it, else after the server's ``--file-ttl`` (30 days by default, OpenAI's
for batch files; a batch's output and error files too). An expired file is
not found at once; the runner's sweep removes it.
"""

from __future__ import annotations

import json
import secrets
import time

from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .... import aio
from ...jobs.errors import RequestFailed
from .access import caller, not_found, openai_error, service, tables

__all__ = ["MAX_FILE_BYTES", "MAX_LINES", "create", "get", "new_id", "read", "routes"]

MAX_FILE_BYTES = 200 << 20       # OpenAI's limit for a batch input file
MAX_LINES = 50_000               # requests in one batch (OpenAI's)
EXPIRES_AFTER_S = (3600, 30 * 86400)    # OpenAI's range of expires_after.seconds
PURPOSES = ("batch",)            # what may be uploaded; batch_output files are made by batches


def new_id(prefix: str) -> str:
    """An unguessable id (128 random bits), such as ``file-3f2a...`` or ``batch_9c1e...``."""
    return prefix + secrets.token_hex(16)


def _bad(message, param=None):
    return RequestFailed("request", message, param=param)


def check_jsonl(data: bytes) -> int:
    """How many request lines ``data`` holds; a 400 naming the first line that is not a JSON object."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _bad(f"the file is not UTF-8 text (byte {exc.start}); upload JSON lines", "file") from None
    n = 0
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise _bad(f"line {i} is not valid JSON ({exc}); a batch file holds one JSON object per line",
                       "file") from None
        if not isinstance(obj, dict):
            raise _bad(f"line {i} is a JSON {type(obj).__name__}, not an object", "file")
        n += 1
        if n > MAX_LINES:
            raise _bad(f"a batch file holds at most {MAX_LINES} requests", "file")
    if n == 0:
        raise _bad("the file holds no request lines", "file")
    return n


async def create(tables, owner: str, filename: str, purpose: str, data: bytes, fid: str | None = None,
                 ttl: float | None = None) -> dict:
    """Keep a file of ``owner`` for ``ttl`` seconds (``None``: until deleted); its record as OpenAI shows it."""
    now = int(time.time())
    record = {"id": fid or new_id("file-"), "object": "file", "bytes": len(data), "created_at": now,
              "expires_at": None if ttl is None else int(now + ttl), "filename": filename, "purpose": purpose,
              "status": "processed", "status_details": None}
    await tables.put_file(dict(record, owner=owner), data)
    return record


async def get(tables, owner: str, fid) -> dict:
    row = await tables.file(fid, owner) if isinstance(fid, str) else None
    if row is None:
        raise not_found("file", fid)
    expires = row.get("expires_at")
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": int(row["created_at"]),
            "expires_at": None if expires is None else int(expires), "filename": row["filename"],
            "purpose": row["purpose"], "status": "processed", "status_details": None}


def expires_after(form) -> int | None:
    """Seconds from OpenAI's ``expires_after`` of an upload form (``None``: not given): the ``openai`` client
    sends ``expires_after[anchor]`` and ``expires_after[seconds]``; a JSON object in ``expires_after`` is
    taken too."""
    anchor, seconds = form.get("expires_after[anchor]"), form.get("expires_after[seconds]")
    if anchor is None and seconds is None and form.get("expires_after") is not None:
        try:
            obj = json.loads(form.get("expires_after"))
        except (TypeError, ValueError):
            obj = None
        if not isinstance(obj, dict):
            raise _bad("expires_after must be an object {\"anchor\": \"created_at\", \"seconds\": S}",
                       "expires_after")
        anchor, seconds = obj.get("anchor"), obj.get("seconds")
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise _bad(f"expires_after.anchor must be 'created_at', got {str(anchor)[:40]!r}", "expires_after.anchor")
    try:
        seconds = int(str(seconds))
    except ValueError:
        seconds = None
    lo, hi = EXPIRES_AFTER_S
    if seconds is None or not lo <= seconds <= hi:
        raise _bad(f"expires_after.seconds must be an integer from {lo} (1 hour) to {hi} (30 days)",
                   "expires_after.seconds")
    return seconds


async def read(tables, owner: str, fid) -> bytes:
    data = await tables.file_data(fid, owner) if isinstance(fid, str) else None
    if data is None:
        raise not_found("file", fid)
    return bytes(data)


def page(records: list, params, default_limit=20, max_limit=10_000) -> dict:
    """OpenAI's list page: ``after`` (an id), ``limit``; newest first unless ``order=asc``."""
    order = params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise _bad("order must be 'asc' or 'desc'", "order")
    items = list(records) if order == "asc" else list(reversed(records))
    after = params.get("after")
    if after:
        ids = [r["id"] for r in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    try:
        limit = int(params.get("limit", default_limit))
    except ValueError:
        raise _bad("limit must be an integer", "limit") from None
    if not 1 <= limit <= max_limit:
        raise _bad(f"limit must be in [1, {max_limit}]", "limit")
    data = items[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(items) > limit}


# --------------------------------------------------------------------------- endpoints
def routes(server) -> list:
    def route(path, fn, method):
        async def endpoint(request):
            async def work(fields):
                return await fn(server, request, tables(server), caller(server, request))
            return await server.guarded(request, f"files.{fn.__name__.strip('_')}", work, openai_error)
        return Route(path, endpoint, methods=[method])
    return [route("/v1/files", _upload, "POST"), route("/v1/files", _list, "GET"),
            route("/v1/files/{file_id}", _retrieve, "GET"), route("/v1/files/{file_id}", _delete, "DELETE"),
            route("/v1/files/{file_id}/content", _content, "GET")]


async def _upload(server, request, db, owner):
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_FILE_BYTES + (1 << 16):
        raise RequestFailed("too_large", f"a file may hold at most {MAX_FILE_BYTES} bytes")
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise _bad("upload a file as multipart/form-data with the fields 'file' and 'purpose' (as OpenAI's API)")
    try:
        async with request.form(max_files=1, max_fields=8) as form:
            purpose = form.get("purpose")
            upload = form.get("file")
            if purpose not in PURPOSES:
                raise _bad(f"purpose must be one of {list(PURPOSES)} (this server keeps files for batches), "
                           f"got {str(purpose)[:40]!r}", "purpose")
            if upload is None or isinstance(upload, str):
                raise _bad("the form has no file: send it in the field 'file'", "file")
            ttl = expires_after(form)
            data = await upload.read(MAX_FILE_BYTES + 1)
            filename = (upload.filename or "upload.jsonl")[:255]
    except RequestFailed:
        raise
    except Exception as exc:  # noqa: BLE001 - python-multipart's and Starlette's parse errors
        raise _bad(f"cannot read the multipart form ({type(exc).__name__}: {exc})") from None
    if len(data) > MAX_FILE_BYTES:
        raise RequestFailed("too_large", f"a file may hold at most {MAX_FILE_BYTES} bytes")
    await aio.to_thread(check_jsonl, data)
    if ttl is None:
        ttl = service(server).config.file_ttl
    return JSONResponse(await create(db, owner, filename, purpose, data, ttl=ttl))


async def _list(server, request, db, owner):
    purpose = request.query_params.get("purpose")
    listed = [await get(db, owner, r["id"]) for r in await db.list_files(owner, purpose)]
    return JSONResponse(page(listed, request.query_params))


async def _retrieve(server, request, db, owner):
    return JSONResponse(await get(db, owner, request.path_params["file_id"]))


async def _delete(server, request, db, owner):
    fid = request.path_params["file_id"]
    if not isinstance(fid, str) or not await db.delete_file(fid, owner):
        raise not_found("file", fid)
    return JSONResponse({"id": fid, "object": "file", "deleted": True})


async def _content(server, request, db, owner):
    return Response(await read(db, owner, request.path_params["file_id"]), media_type="application/octet-stream")
