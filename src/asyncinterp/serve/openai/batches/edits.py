"""Named edits registered while the server runs: ``POST /v1/edits``, ``GET /v1/edits``, ``DELETE /v1/edits/{name}``.

Why this module exists: an edit named at server start (``--edit``) needs a
restart to add, change or retire. Here an admin key registers one at run
time, in any form ``--edit`` takes (JSON body)::

    {"name": "calm", "spec": "steer:module=transformer.h.0,vector=[...],strength=4"}   # INTERVENTION:params
    {"name": "calm", "spec": "edits.py:calm"}              # a Python file on the server: FILE.py:FUNCTION
    {"name": "calm", "source": "async def calm(m): ...", "function": "calm"}    # the file's text, sent
    {"name": "calm", "intervention": "steer", "params": {...}}                   # the same, as JSON

and, once it has run on a one-token trial (an edit that fails is refused
with its error), it is usable at once by model name (``MODEL:calm``),
through every endpoint that takes one. An edit is versioned by its content hash (the
file's source and the function's name, or the intervention's source and its
parameters; :mod:`..model_names`). Posting a name again replaces its edit:
the hash changes, and with it the prefix-cache scope of requests under it
(on vLLM, KV blocks computed under the old version are never reused for the
new). A request resolves its model name once, when it starts, and keeps
that version to its end. ``DELETE`` retires an edit: its model name is a
404 from then on.

Registered edits are kept in the kept-jobs store (a file's text is kept
too, so the edit does not depend on the file staying where it was),
installed again when the server restarts, and followed by every replica
sharing the store (each looks every two seconds). Edits named with ``--edit`` are
listed but cannot be replaced or removed here. Under process isolation the
worker processes receive their edits when they start, so a runtime change
is refused there (the stored ones are installed at start).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import tempfile
import time

from starlette.responses import JSONResponse
from starlette.routing import Route

from ...jobs.errors import RequestFailed
from .. import model_names
from .access import openai_error, require_admin, tables

log = logging.getLogger("asyncinterp.serve")
SYNC_S = 2.0      # how often a server brings its runtime edits in step with the store
TRIAL_PROMPT = "Hello"   # what a newly registered edit is tried on before it is served

__all__ = ["EditRegistry", "routes"]


def _bad(message, param=None):
    return RequestFailed("request", message, param=param)


class EditRegistry:
    """The runtime edits of ``server``: installed in its model names, kept in the kept-jobs store."""

    def __init__(self, server):
        self.server = server
        self.runtime: dict[str, str] = {}        # name -> hash of the runtime edits installed here
        self.sources = {}                        # hash of a file's text -> its path (one file per text)
        self.follower = None                     # the task that follows the store (load)
        self.lock = asyncio.Lock()               # one change at a time: a request's, or the follower's

    # ------------------------------------------------------------------ installing
    def _source_path(self, source: str) -> str:
        """A file holding ``source`` (edits load from a file, as ``--edit`` does; its text is the content hashed)."""
        key = hashlib.sha256(source.encode()).hexdigest()
        if key not in self.sources:
            folder = tempfile.mkdtemp(prefix="asyncinterp-edit-")
            path = os.path.join(folder, f"edit_{key[:16]}.py")
            with open(path, "w", encoding="utf-8") as f:
                f.write(source)
            self.sources[key] = path
        return self.sources[key]

    def install(self, record: dict) -> model_names.Edit:
        """Install ``record``'s edit (its older version replaced between two requests: none sees the name missing);
        ``ValueError`` (or the loader's error) saying what is wrong otherwise."""
        names = self.server.names
        old = names.edits.pop(record["name"], None)
        try:
            if record["kind"] == "function":
                fn = model_names.load_edit_function(self._source_path(record["source"]), record["function"])
                edit = model_names.install_edit(self.server, record["name"], fn, origin=record["origin"])
            else:
                edit = model_names.install_edit(self.server, record["name"], intervention=record["intervention"],
                                                params=record["params"], origin=record["origin"])
        except BaseException:
            if old is not None:
                names.edits[record["name"]] = old
            raise
        self.runtime[record["name"]] = edit.digest
        return edit

    async def trial(self, edit) -> None:
        """Run ``edit`` once (one new token of a one-word prompt): an edit that fails is refused now (400, with
        its error), not on every request that names it."""
        if not self.server.is_lm:
            return
        try:
            await self.server.batcher.generate(TRIAL_PROMPT, edit.fn, max_new_tokens=1, timeout=self.server.timeout)
        except Exception as exc:  # noqa: BLE001 - the edit's own failure, reported to whoever registered it
            raise _bad(f"edit {edit.name!r} failed on a trial run ({TRIAL_PROMPT!r}, one token): "
                       f"{type(exc).__name__}: {exc}") from None

    def retire(self, name: str) -> None:
        self.server.names.edits.pop(name, None)
        self.runtime.pop(name, None)

    async def sync(self) -> None:
        """Make this server's runtime edits those of the store (at start, and now and then: replicas converge)."""
        async with self.lock:
            await self._sync()

    async def _sync(self) -> None:
        stored = await tables(self.server, "runtime edits").all_edits()
        for name in [n for n in self.runtime if n not in stored]:
            self.retire(name)
        for name, record in stored.items():
            if self.runtime.get(name) == record["hash"]:
                continue
            if name in self.server.names.edits and name not in self.runtime:
                log.error("stored edit %r not installed: the name is taken by an edit given at start (--edit)", name,
                          extra={"fields": {"event": "edits", "edit": name}})
                continue
            try:
                self.install(record)
            except Exception as exc:  # noqa: BLE001 - e.g. its intervention is no longer registered
                log.error("stored edit %r not installed: %s", name, exc,
                          extra={"fields": {"event": "edits", "edit": name}})

    # ------------------------------------------------------------------ requests
    async def register(self, obj) -> dict:
        """Register (or replace) the edit ``obj`` describes; the stored record."""
        async with self.lock:
            return await self._register(obj)

    async def _register(self, obj) -> dict:
        if self.server.supervised:
            raise _bad("this server runs its model in worker processes (process isolation), which receive their "
                       "edits when they start: register edits at start (--edit), or serve with --isolation thread")
        record = _record(obj)
        name = record["name"]
        db = tables(self.server, "runtime edits")
        if name in self.server.names.edits and name not in self.runtime:
            raise RequestFailed("conflict", f"the edit {name!r} was installed at start (--edit); it cannot be "
                                            "replaced or removed at run time")
        previous = (await db.all_edits()).get(name)
        old = self.server.names.edits.get(name)
        try:
            edit = self.install(record)
        except (ValueError, FileNotFoundError, SyntaxError, TypeError, ImportError) as exc:
            raise _bad(f"edit {name!r}: {type(exc).__name__}: {exc}") from None
        try:
            await self.trial(edit)
        except BaseException:
            self.retire(name)
            if old is not None:
                self.server.names.edits[name] = old
                self.runtime[name] = old.digest
            raise
        same = previous is not None and previous["hash"] == edit.digest
        record.update(hash=edit.digest, created_at=time.time(),
                      version=(previous or {}).get("version", 0) + (0 if same else 1))
        try:
            await db.put_edit(record)
        except BaseException:
            self.retire(name)                      # not kept: not served either
            if old is not None:
                self.server.names.edits[name] = old
            raise
        return record

    async def remove(self, name) -> dict:
        async with self.lock:
            return await self._remove(name)

    async def _remove(self, name) -> dict:
        if self.server.supervised:
            raise _bad("this server runs its model in worker processes: its edits change only at a restart")
        if isinstance(name, str) and name in self.server.names.edits and name not in self.runtime:
            raise RequestFailed("conflict", f"the edit {name!r} was installed at start (--edit); it cannot be "
                                            "removed at run time")
        if not isinstance(name, str) or not await tables(self.server, "runtime edits").delete_edit(name):
            raise RequestFailed("not_found", f"no runtime edit named {str(name)[:64]!r} (GET /v1/edits)")
        self.retire(name)
        return {"name": name, "object": "edit", "deleted": True}

    def listed(self) -> list:
        names = self.server.names
        return [{"name": name, "object": "edit", "model": f"{names.base}:{name}", "hash": edit.digest,
                 "origin": edit.origin, "runtime": name in self.runtime,
                 "cache_scope": model_names.Selection(name, (edit,)).scope} for name, edit in names.edits.items()]


def registry(server) -> EditRegistry:
    """The server's registry (made at its first use)."""
    reg = getattr(server, "runtime_edits", None)
    if reg is None:
        reg = server.runtime_edits = EditRegistry(server)
    return reg


async def load(server) -> None:
    """At the server's start (its kept-jobs store open): install the stored edits, and keep them in step with
    the store every :data:`SYNC_S` seconds (another replica may register or retire one)."""
    reg = registry(server)
    await reg.sync()

    async def follow():
        while True:
            await asyncio.sleep(SYNC_S)
            try:
                await reg.sync()
            except Exception:  # noqa: BLE001 - the database may be briefly unreachable: try again
                log.exception("syncing runtime edits failed", extra={"fields": {"event": "edits"}})
    reg.follower = asyncio.get_running_loop().create_task(follow())


async def close(server) -> None:
    """Stop following the store (at the server's shutdown)."""
    follower = getattr(getattr(server, "runtime_edits", None), "follower", None)
    if follower is not None:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)


def _record(obj) -> dict:
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
                return JSONResponse(await fn(registry(server), request))
            return await server.guarded(request, f"edits.{fn.__name__.strip('_')}", work, openai_error)
        return Route(path, endpoint, methods=[method])
    return [route("/v1/edits", _register, "POST", True), route("/v1/edits", _list, "GET", False),
            route("/v1/edits/{name}", _remove, "DELETE", True)]


async def _register(reg, request):
    try:
        obj = json.loads(await reg.server.read_body(request))
    except ValueError:
        raise _bad("the body must be a JSON object") from None
    record = await reg.register(obj)
    return {k: v for k, v in record.items() if k != "source"} | {"object": "edit",
                                                                 "model": f"{reg.server.names.base}:{record['name']}"}


async def _list(reg, request):
    return {"object": "list", "data": reg.listed()}


async def _remove(reg, request):
    return await reg.remove(request.path_params["name"])
