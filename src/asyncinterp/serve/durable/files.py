"""OpenAI's Files API, for batches: ``POST /v1/files``, ``GET /v1/files[/{id}[/content]]``, ``DELETE /v1/files/{id}``.

Why this module exists: the stock ``openai`` client runs a batch by
uploading its requests as a JSON-lines file (``files.create(file=...,
purpose="batch")``, multipart as OpenAI's), naming the file in
``batches.create``, and downloading the answers with ``files.content``.
Files are kept under the state directory (:mod:`.records`), belong to the
API key that uploaded them (another key gets 404), and are returned byte
for byte. A batch's output and error files are files of its owner too
(purpose ``batch_output``).

An upload with purpose ``batch`` is checked at once: UTF-8 JSON lines, each
an object, at most :data:`MAX_LINES` of them (OpenAI's limit); what each
line asks for is checked when a batch uses the file (:mod:`.batch_lines`).
"""

from __future__ import annotations

import json
import time

from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ... import aio
from ..errors import RequestFailed
from .access import caller, not_found, openai_error
from .records import new_id

__all__ = ["MAX_FILE_BYTES", "MAX_LINES", "Files", "routes"]

MAX_FILE_BYTES = 200 << 20       # OpenAI's limit for a batch input file
MAX_LINES = 50_000               # requests in one batch (OpenAI's)
PURPOSES = ("batch",)            # what may be uploaded; batch_output files are made by batches


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


class Files:
    """The files of one server (records and bytes under ``store``, a :class:`~.records.Records`)."""

    def __init__(self, store):
        self.store = store

    def create(self, owner: str, filename: str, purpose: str, data: bytes, fid: str | None = None) -> dict:
        fid = fid or new_id("file-")
        self.store.put_blob(fid, data)
        record = {"id": fid, "object": "file", "bytes": len(data), "created_at": int(time.time()),
                  "expires_at": None, "filename": filename, "purpose": purpose, "status": "processed",
                  "status_details": None, "owner": owner}
        self.store.put(fid, record)       # the bytes first: a record never names missing bytes
        return record

    def get(self, owner: str, fid) -> dict:
        record = self.store.get(fid) if isinstance(fid, str) else None
        if record is None or record["owner"] != owner:
            raise not_found("file", fid)
        return record

    def read(self, owner: str, fid) -> bytes:
        record = self.get(owner, fid)
        with open(self.store.blob_path(record["id"]), "rb") as f:
            return f.read()

    def delete(self, owner: str, fid) -> dict:
        record = self.get(owner, fid)
        self.store.delete(record["id"], ".data")
        return {"id": record["id"], "object": "file", "deleted": True}

    def listed(self, owner: str, purpose=None) -> list:
        return [r for r in self.store.all() if r["owner"] == owner and (purpose is None or r["purpose"] == purpose)]


def public(record: dict) -> dict:
    """A file record as OpenAI shows it (the owner stays on the server)."""
    return {k: v for k, v in record.items() if k != "owner"}


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
                return await fn(server, request, caller(server, request))
            return await server.guarded(request, f"files.{fn.__name__.strip('_')}", work, openai_error)
        return Route(path, endpoint, methods=[method])
    return [route("/v1/files", _upload, "POST"), route("/v1/files", _list, "GET"),
            route("/v1/files/{file_id}", _retrieve, "GET"), route("/v1/files/{file_id}", _delete, "DELETE"),
            route("/v1/files/{file_id}/content", _content, "GET")]


async def _upload(server, request, owner):
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
            data = await upload.read(MAX_FILE_BYTES + 1)
            filename = (upload.filename or "upload.jsonl")[:255]
    except RequestFailed:
        raise
    except Exception as exc:  # noqa: BLE001 - python-multipart's and Starlette's parse errors
        raise _bad(f"cannot read the multipart form ({type(exc).__name__}: {exc})") from None
    if len(data) > MAX_FILE_BYTES:
        raise RequestFailed("too_large", f"a file may hold at most {MAX_FILE_BYTES} bytes")
    check_jsonl(data)
    record = await aio.to_thread(_files(server).create, owner, filename, purpose, data)   # fsync off the loop
    return JSONResponse(public(record))


def _files(server):
    return server.durable.files


async def _list(server, request, owner):
    purpose = request.query_params.get("purpose")
    return JSONResponse(page([public(r) for r in _files(server).listed(owner, purpose)], request.query_params))


async def _retrieve(server, request, owner):
    return JSONResponse(public(_files(server).get(owner, request.path_params["file_id"])))


async def _delete(server, request, owner):
    return JSONResponse(_files(server).delete(owner, request.path_params["file_id"]))


async def _content(server, request, owner):
    fid = request.path_params["file_id"]
    data = _files(server).read(owner, fid)
    return Response(data, media_type="application/octet-stream")
