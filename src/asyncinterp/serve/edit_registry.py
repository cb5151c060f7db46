"""Named edits registered while the server runs: ``POST /v1/edits``, ``GET /v1/edits``, ``DELETE /v1/edits/{name}``.

Why this module exists: an edit named at server start (``--edit``) needs a
restart to add, change or retire. Here an admin key registers one at run
time, in any form ``--edit`` takes (JSON body)::

    {"name": "calm", "spec": "steer:module=transformer.h.0,vector=[...],strength=4"}   # INTERVENTION:params
    {"name": "calm", "spec": "edits.py:calm"}              # a Python file on the server: FILE.py:FUNCTION
    {"name": "calm", "source": "async def calm(m): ...", "function": "calm"}    # the file's text, sent
    {"name": "calm", "intervention": "steer", "params": {...}}                   # the same, as JSON

and it is usable at once by model name (``MODEL:calm``), through every
endpoint that takes one. An edit is versioned by its content hash (the
file's source and the function's name, or the intervention's source and its
parameters; :mod:`.model_names`). Posting a name again replaces its edit:
the hash changes, and with it the prefix-cache scope of requests under it
(on vLLM, KV blocks computed under the old version are never reused for the
new). A request resolves its model name once, when it starts, and keeps
that version to its end. ``DELETE`` retires an edit: its model name is a
404 from then on.

Registered edits are kept in the state directory (a file's source is kept
too, so the edit does not depend on the file staying where it was) and
installed again when the server restarts. Edits named with ``--edit`` are
listed but cannot be replaced or removed here. Under process isolation the
worker processes receive their edits when they start, so a runtime change
is refused there (the stored ones are installed at start).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time

from starlette.responses import JSONResponse
from starlette.routing import Route

from . import model_names
from .durable.access import openai_error, require_admin
from .errors import RequestFailed

__all__ = ["EditRegistry", "routes"]


def _bad(message, param=None):
    return RequestFailed("request", message, param=param)


class EditRegistry:
    """The runtime edits of ``server``, kept in ``store`` (a :class:`~.durable.records.Records`)."""

    def __init__(self, server, store):
        self.server = server
        self.store = store
        self.loaded = False

    # ------------------------------------------------------------------ what is kept
    def _source_path(self, source: str) -> str:
        digest = hashlib.sha256(source.encode()).hexdigest()[:40]
        path = self.store.blob_path("src-" + digest, ".py")
        if not os.path.exists(path):
            self.store.put_blob("src-" + digest, source.encode(), ".py")
        return path

    def _install(self, record: dict) -> model_names.Edit:
        """Install ``record``'s edit on the server (replacing its older version atomically: no request sees the
        name missing); ``ValueError`` saying what is wrong otherwise."""
        names = self.server.names
        old = names.edits.pop(record["name"], None)
        try:
            if record["kind"] == "function":
                path = self._source_path(record["source"])
                fn = model_names.load_edit_function(path, record["function"])
                edit = model_names.install_edit(self.server, record["name"], fn, origin=record["origin"])
            else:
                edit = model_names.install_edit(self.server, record["name"], intervention=record["intervention"],
                                                params=record["params"], origin=record["origin"])
        except BaseException:
            if old is not None:
                names.edits[record["name"]] = old
            raise
        return edit

    def load(self) -> None:
        """Install the stored edits (at the server's start); one that no longer installs is logged and skipped."""
        if self.loaded:
            return
        self.loaded = True
        log = logging.getLogger("asyncinterp.serve")
        for record in self.store.all():
            try:
                self._install(record)
            except Exception as exc:  # noqa: BLE001 - e.g. its intervention is no longer registered
                log.error("stored edit %r not installed: %s", record.get("name"), exc,
                          extra={"fields": {"event": "startup", "edit": record.get("name")}})

    # ------------------------------------------------------------------ requests
    def register(self, obj: dict) -> dict:
        """Register (or replace) the edit ``obj`` describes; the stored record."""
        if self.server.supervised:
            raise _bad("this server runs its model in worker processes (process isolation), which receive their "
                       "edits when they start: register edits at start (--edit), or serve with --isolation thread")
        record = self._record(obj)
        name = record["name"]
        if name in self.server.names.edits and self.store.get(name) is None:
            raise RequestFailed("conflict", f"the edit {name!r} was installed at start (--edit); it cannot be "
                                            "replaced or removed at run time")
        previous = self.store.get(name)
        try:
            edit = self._install(record)
        except (ValueError, FileNotFoundError, SyntaxError, TypeError) as exc:
            raise _bad(f"edit {name!r}: {exc}") from None
        record.update(hash=edit.digest, created_at=int(time.time()),
                      version=(previous or {}).get("version", 0) + (0 if previous and previous["hash"] ==
                                                                     edit.digest else 1))
        self.store.put(name, record)
        return record

    def _record(self, obj: dict) -> dict:
        if not isinstance(obj, dict):
            raise _bad("the body must be a JSON object: {'name', 'spec'} or {'name', 'source', 'function'} or "
                       "{'name', 'intervention', 'params'}")
        extra = sorted(set(obj) - {"name", "spec", "source", "function", "intervention", "params"})
        if extra:
            raise _bad(f"unknown field(s) {extra}; an edit takes name and one of: spec ('FILE.py:FUNCTION' or "
                       "'INTERVENTION:k=v,...', as --edit), source + function, intervention + params", extra[0])
        name = obj.get("name")
        if not isinstance(name, str) or not model_names.NAME.match(name):
            raise _bad("name must be 1-64 letters, digits, '_', '-' or '.'", "name")
        forms = [k for k in ("spec", "source", "intervention") if k in obj]
        if len(forms) != 1:
            raise _bad("give exactly one of spec, source (with function) or intervention (with params)")
        try:
            if "spec" in obj:
                if not isinstance(obj["spec"], str):
                    raise ValueError("spec must be a string, as --edit NAME=SPEC takes it")
                _, (kind, target, extra_) = model_names.parse_edit_option(f"{name}={obj['spec']}")
                if kind == "file":
                    if not os.path.isfile(target):
                        raise ValueError(f"no file {target!r} on the server (send its text as 'source' instead)")
                    with open(target, encoding="utf-8") as f:
                        return _function(name, f.read(), extra_, obj["spec"])
                return _intervention(name, target, extra_, obj["spec"])
            if "source" in obj:
                return _function(name, obj["source"], obj.get("function"), None)
            return _intervention(name, obj["intervention"], obj.get("params") or {}, None)
        except ValueError as exc:
            raise _bad(f"edit {name!r}: {exc}") from None

    def remove(self, name: str) -> dict:
        record = self.store.get(name) if isinstance(name, str) else None
        if record is None:
            if isinstance(name, str) and name in self.server.names.edits:
                raise RequestFailed("conflict", f"the edit {name!r} was installed at start (--edit); it cannot be "
                                                "removed at run time")
            raise RequestFailed("not_found", f"no runtime edit named {str(name)[:64]!r} (GET /v1/edits)")
        if self.server.supervised:
            raise _bad("this server runs its model in worker processes: its edits change only at a restart")
        self.store.delete(name)
        self.server.names.edits.pop(name, None)
        return {"name": name, "object": "edit", "deleted": True}

    def listed(self) -> list:
        out = []
        names = self.server.names
        for name, edit in names.edits.items():
            record = self.store.get(name)
            out.append({"name": name, "object": "edit", "model": f"{names.base}:{name}", "hash": edit.digest,
                        "origin": edit.origin, "runtime": record is not None,
                        "version": record["version"] if record else None,
                        "created_at": record["created_at"] if record else None,
                        "cache_scope": model_names.Selection(name, (edit,)).scope})
        return out


def _function(name, source, function, origin) -> dict:
    if not isinstance(source, str) or not source.strip():
        raise ValueError("source must be the text of a Python file")
    if not isinstance(function, str) or not function.isidentifier():
        raise ValueError("function must name the file's async def to run every forward pass")
    return {"name": name, "kind": "function", "source": source, "function": function,
            "origin": origin or f"<source>:{function}"}


def _intervention(name, intervention, params, origin) -> dict:
    if not isinstance(intervention, str) or not isinstance(params, dict):
        raise ValueError("intervention must be a registered intervention's name and params a JSON object")
    return {"name": name, "kind": "intervention", "intervention": intervention, "params": params,
            "origin": origin or f"{intervention}:{json.dumps(params, sort_keys=True)[:200]}"}


# --------------------------------------------------------------------------- endpoints
def routes(server) -> list:
    def route(path, fn, method, admin):
        async def endpoint(request):
            async def work(fields):
                if admin:
                    require_admin(server, request, f"{method} {path}")
                server.durable.start()
                return await fn(server.durable.edits, request)
            return await server.guarded(request, f"edits.{fn.__name__.strip('_')}", work, openai_error)
        return Route(path, endpoint, methods=[method])
    return [route("/v1/edits", _register, "POST", True), route("/v1/edits", _list, "GET", False),
            route("/v1/edits/{name}", _remove, "DELETE", True)]


async def _register(registry, request):
    try:
        obj = json.loads(await registry.server.read_body(request))
    except ValueError:
        raise _bad("the body must be a JSON object") from None
    record = registry.register(obj)     # in the event loop: the old version is replaced between two requests
    return JSONResponse({k: v for k, v in record.items() if k != "source"} | {"object": "edit"})


async def _list(registry, request):
    return JSONResponse({"object": "list", "data": registry.listed()})


async def _remove(registry, request):
    return JSONResponse(registry.remove(request.path_params["name"]))

