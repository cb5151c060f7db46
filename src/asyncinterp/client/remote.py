"""``ai.remote(url)``: a model on a server with the local model's surface.

    lm = ai.remote("http://127.0.0.1:8000", api_key="secret")     # instead of ai.LanguageModel...
    top = lm.trace("The Eiffel Tower is in", fn)                   # same functions, same results
    with lm.trace() as tr:                                        # any number of invokes, one request
        tr.invoke(clean, record)
        p = tr.invoke(corrupted, patch)
    g = lm.generate("Once upon a time", steer, max_new_tokens=20)  # g.result, g.tokens, g.text

A remote model is one more engine that takes jobs (:mod:`asyncinterp.engine`):
``trace``/``generate`` build the same :class:`~asyncinterp.job.Job` as
locally (``Trace``: late-binding check, ``on_error``, result carriers), and
running it sends the job (:func:`~.job_wire.dumps_job`: every intervention
captured with what it reads) to ``POST /v1/jobs`` (:mod:`.jobs_api`) as one
request. Results come back into the invokes (``inv.result`` as locally; an
error raised remotely is a :class:`~.wire.RemoteError` that is also an
instance of the original builtin or asyncinterp exception class, so
``except ValueError`` works on both sides).

Module names are checked here, before anything is sent, against the served
model's tree (``GET /v1/model``, fetched once; :mod:`.remote_check`), and the
versions of both sides are compared (:mod:`.protocol`). Async code uses
``atrace``/``agenerate`` (asyncio or trio, through anyio: the request runs
in a worker thread; cancelling closes it and the server stops the job at its
next hook point). ``stream``/``astream`` give a generation's tokens and
emitted values (``ai.serve.emit``) as they are produced.
"""

from __future__ import annotations

import builtins
import http.client
import queue
import threading

import httpx
import torch

from ..engine import describe_invoke
from ..invoke import Invoke
from ..job import Trace
from ..kernel import errors as kernel_errors
from ..kernel.errors import RunCancelled
from . import job_post, wire
from .cache_wire import fill_cache
from .clients import _decode_response, session_body
from .job_form import Named, dumps_job
from .protocol import VersionMismatch, incompatible, versions
from .remote_check import ModuleTree, check_names
from .wire import RemoteError

__all__ = ["RemoteModel", "RemoteInvoke", "RemoteGeneration", "remote"]

_NOTHING = object()
MSGPACK = "application/msgpack"


def remote(url: str, api_key: str | None = None, *, timeout: float = 120.0, check_modules: bool = True,
           **httpx_kwargs) -> "RemoteModel":
    """A model served at ``url`` (``asyncinterp serve``), used like a local one (see the module docs).

    ``timeout``: seconds for one request (the server applies its own limit too); ``check_modules``:
    check module names on the client against the served model's tree.
    """
    return RemoteModel(url, api_key, timeout=timeout, check_modules=check_modules, **httpx_kwargs)


class RemoteModel:
    """A served model: ``trace``/``atrace``, ``generate``/``agenerate``, ``stream``, ``registered``, ``session``."""

    edits = ()   # persistent edits (model.edit) do not run remotely
    travels_as_model = True   # an intervention that reads this object gets the served model (capture)
    path = ""

    def __init__(self, url: str, api_key: str | None = None, *, timeout: float = 120.0,
                 check_modules: bool = True, **httpx_kwargs):
        self.url = url.rstrip("/")
        self.headers = {"content-type": MSGPACK, "accept": MSGPACK}
        if api_key:
            self.headers["authorization"] = f"Bearer {api_key}"
        self.timeout = float(timeout)
        self.check_modules = check_modules
        self.versions = versions()    # what this client sends (and compares with the server's)
        self.http = httpx.Client(timeout=httpx.Timeout(self.timeout + 10.0, connect=10.0), **httpx_kwargs)
        # jobs go over lean keep-alive connections where that behaves as httpx would (plain http, no proxy)
        self.poster = job_post.JobPoster(self.url, self.timeout + 10.0) \
            if job_post.usable(self.url, httpx_kwargs) else None
        self._info = None
        self._tree = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the served model
    def info(self) -> dict:
        """``GET /v1/model`` (fetched once): the module tree, limits, versions; checks the versions."""
        with self._lock:
            if self._info is None:
                r = self.http.get(f"{self.url}/v1/model", headers=self.headers)
                if r.status_code != 200:
                    try:
                        error = r.json().get("error")
                    except ValueError:
                        error = {"type": "HTTPError", "message": r.text[:300]}
                    raise RemoteError.from_wire(error, r.status_code)
                info = r.json()
                why = incompatible(self.versions, info)
                if why:
                    raise VersionMismatch(why)
                self._info = info
            return self._info

    async def ainfo(self) -> dict:
        """:meth:`info` from async code (fetched in a worker thread)."""
        if self._info is not None:
            return self._info
        import anyio
        return await anyio.to_thread.run_sync(self.info)

    def tree(self) -> ModuleTree:
        """The served model's module tree."""
        if self._tree is None:
            self._tree = ModuleTree(self.info()["modules"])
        return self._tree

    def engine(self, kind: str = "trace") -> "RemoteEngine":
        if kind not in ("trace", "generate"):
            raise ValueError(f"a remote model runs jobs of kind 'trace' or 'generate', got {kind!r}")
        return RemoteEngine(self, kind)

    def registered(self, name: str, **params) -> Named:
        """An intervention registered on the server, by name (``GET /v1/model`` lists them)."""
        return Named(name, params)

    # ------------------------------------------------------------------ running
    def trace(self, input=_NOTHING, *fns, on_error: str = "stop", blocking: bool = True, **kwargs):
        """``trace(x, fn)`` returns ``fn``'s result; ``trace()`` a :class:`Trace` for ``with`` and ``tr.invoke``.
        ``blocking=False``: submit it and return a job handle at once (docs/jobs.md)."""
        if input is _NOTHING and not fns:
            return Trace(self, "trace", on_error)
        if not fns:
            raise TypeError("a remote trace returns what its interventions return, not the model's output; pass "
                            "one (`async def out(m): return await m.output`)")
        trace = Trace(self, "trace", on_error)
        inv = trace.invoke(None if input is _NOTHING else input, *fns, **kwargs)
        if not blocking:
            return self._submit(trace, "value")
        trace.run()
        return inv.result

    async def atrace(self, input=_NOTHING, *fns, on_error: str = "stop", **kwargs):
        """:meth:`trace` for async code (asyncio or trio); cancelling it cancels the job on the server."""
        if input is _NOTHING and not fns:
            raise TypeError("atrace needs an input and an intervention; for several invokes use "
                            "`async with model.trace() as tr:`")
        await self.ainfo()
        trace = Trace(self, "trace", on_error)
        inv = trace.invoke(None if input is _NOTHING else input, *fns, **kwargs)
        await trace.arun()
        return inv.result

    def generate(self, input=_NOTHING, *fns, max_new_tokens: int = 20, on_error: str = "stop", blocking: bool = True,
                 **options):
        """As ``LanguageModel.generate``: returns the invoke (``.result``, ``.tokens``, ``.text``, ``.emitted``);
        ``blocking=False``: a job handle whose ``result()`` is that invoke."""
        tr = Trace(self, "generate", on_error, generation=dict(options, max_new_tokens=max_new_tokens))
        if input is _NOTHING and not fns:
            return tr
        inv = tr.invoke(None if input is _NOTHING else input, *fns)
        if not blocking:
            return self._submit(tr, "invoke")
        tr.run()
        return inv

    async def agenerate(self, input=_NOTHING, *fns, max_new_tokens: int = 20, on_error: str = "stop", **options):
        """:meth:`generate` for async code."""
        await self.ainfo()
        tr = Trace(self, "generate", on_error, generation=dict(options, max_new_tokens=max_new_tokens))
        inv = tr.invoke(input, *fns)
        await tr.arun()
        return inv

    def stream(self, input, *fns, max_new_tokens: int = 20, on_error: str = "stop", **options):
        """Iterate over a remote generation's events as they are produced.

        ``{"event": "token", "invoke", "step", "token", "text"}`` per token, ``{"event": "emit", "invoke",
        "step", "value"}`` per ``ai.serve.emit(value)``, and last ``{"event": "done", "result": invoke}``.
        """
        tr = Trace(self, "generate", on_error, generation=dict(options, max_new_tokens=max_new_tokens))
        inv = tr.invoke(input, *fns)
        execution = tr.start()
        items = queue.Queue()

        def work():
            try:
                execution.wait(on_event=items.put)
                items.put({"event": "done", "result": inv})
            except BaseException as exc:  # noqa: BLE001 - re-raised in the iterating thread
                items.put(exc)

        thread = threading.Thread(target=work, name="asyncinterp-remote-stream", daemon=True)
        thread.start()
        try:
            while True:
                item = items.get(timeout=self.timeout + 30.0)
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item["event"] == "done":
                    return
        finally:
            execution.cancel()
            thread.join(self.timeout + 30.0)

    async def astream(self, input, *fns, max_new_tokens: int = 20, on_error: str = "stop", **options):
        """:meth:`stream` for async code (asyncio or trio): ``async for event in lm.astream(...)``."""
        import anyio
        await self.ainfo()
        tr = Trace(self, "generate", on_error, generation=dict(options, max_new_tokens=max_new_tokens))
        inv = tr.invoke(input, *fns)
        execution = tr.start()
        send, receive = anyio.create_memory_object_stream(float("inf"))
        token = anyio.lowlevel.current_token()

        def forward(event):
            anyio.from_thread.run_sync(send.send_nowait, event, token=token)

        async def work():
            try:
                await anyio.to_thread.run_sync(lambda: execution.wait(on_event=forward), abandon_on_cancel=True)
                send.send_nowait({"event": "done", "result": inv})
            except BaseException as exc:  # noqa: BLE001 - re-raised in the iterating task
                send.send_nowait(exc)
                if isinstance(exc, anyio.get_cancelled_exc_class()):
                    raise

        async with anyio.create_task_group() as tg:
            tg.start_soon(work)
            try:
                async with receive:
                    async for item in receive:
                        if isinstance(item, BaseException):
                            raise item
                        yield item
                        if item["event"] == "done":
                            return
            finally:
                execution.cancel()
                tg.cancel_scope.cancel()

    # ------------------------------------------------------------------ sessions
    def session(self, fn=None, /, *, timeout: float | None = None, blocking: bool = True, **keywords):
        """Run a session on the server: ``fn`` is an ``async def fn(model, **keywords)`` that runs several traces
        (``await model.atrace(...)``, ``await model.agenerate(...)``), values flowing between them; it travels
        once (``POST /v1/sessions``), its traces join the server's shared batches, and only its return value
        comes back. The same function runs locally: ``await fn(local_model)``.
        """
        if fn is None:
            raise TypeError("a remote session is a function: write the runs as `async def sweep(model): ... "
                            "await model.atrace(x, fn) ...` and call `lm.session(sweep)` (locally: "
                            "`await sweep(lm)`); a `with model.session()` block cannot travel")
        if not blocking:
            body = wire.unpackb(self._session_body(fn, timeout, keywords), wire.answer_limits(1 << 30))
            return self._post_job("/v1/sessions", {**body, "wait": False, "returns": "value"}, None)
        r = self.http.post(f"{self.url}/v1/sessions", content=self._session_body(fn, timeout, keywords),
                           headers=self.headers, timeout=self._request_timeout(timeout))
        return _session_result(r.status_code, r.content)

    async def asession(self, fn, /, *, timeout: float | None = None, **keywords):
        """:meth:`session` for async code (asyncio or trio); cancelling it stops the session on the server."""
        import anyio
        body = self._session_body(fn, timeout, keywords)
        async with httpx.AsyncClient(timeout=self._request_timeout(timeout)) as http:
            r = await http.post(f"{self.url}/v1/sessions", content=body, headers=self.headers)
        await anyio.lowlevel.checkpoint()
        return _session_result(r.status_code, r.content)

    def _session_body(self, fn, timeout, keywords) -> bytes:
        import functools
        if not callable(fn):
            raise TypeError(f"a session is an `async def` taking the model, got {type(fn).__name__}")
        return session_body(functools.partial(fn, **keywords) if keywords else fn, timeout)

    def _request_timeout(self, timeout):
        t = self.timeout if timeout is None else float(timeout)
        return httpx.Timeout(t + 10.0, connect=10.0)

    # ------------------------------------------------------------------ kept jobs (docs/jobs.md)
    def submit(self, tr: Trace):
        """Submit a trace built with ``tr = lm.trace()`` / ``tr.invoke(...)`` without waiting: a job handle
        whose ``result()`` is the list of its invokes."""
        if not isinstance(tr, Trace) or tr.model is not self:
            raise TypeError("submit takes a trace of this remote model (`tr = lm.trace(); tr.invoke(x, fn)`)")
        return self._submit(tr, "invokes" if tr.on_error == "stop" else "invokes+")

    def _submit(self, tr: Trace, returns: str):
        self.info()   # the version check, once
        job = tr.job
        body = {**self.versions, "job": dumps_job(job), "wait": False, "returns": returns}
        return self._post_job("/v1/jobs", body, job.results)

    def _post_job(self, path, body, carriers):
        from .jobs_handle import RemoteJob
        r = self.http.post(f"{self.url}{path}", content=wire.packb(body), headers=self.headers)
        if r.status_code != 202:
            try:
                _decode_response(r.status_code, r.content)
            except RemoteError as exc:
                raise remote_exception(exc) from None
            raise RemoteError("ProtocolError", f"HTTP {r.status_code}: the server did not keep the job")
        return RemoteJob(self, r.json(), carriers)

    def job(self, job_id: str):
        """The handle of a job submitted earlier with this API key (from any process): ``status()``, ``result()``."""
        from .jobs_handle import RemoteJob, _json
        return RemoteJob(self, _json(self.http.get(f"{self.url}/v1/jobs/{job_id}", headers=self.headers)))

    def jobs(self, limit: int = 20, state: str | None = None) -> list:
        """Handles of this key's newest jobs (at most ``limit``, optionally only those in ``state``)."""
        from .jobs_handle import RemoteJob, _json
        params = {"limit": limit, **({"state": state} if state else {})}
        page = _json(self.http.get(f"{self.url}/v1/jobs", params=params, headers=self.headers))
        return [RemoteJob(self, info) for info in page["data"]]

    def job_error(self, error, status):
        """A kept job's error as the blocking call would raise it."""
        return remote_exception(RemoteError.from_wire(error, status))

    def job_answer(self, handle, status, content):
        """What the blocking call of ``handle``'s job gives, from its kept answer (or its error, raised)."""
        from .jobs_handle import answer_of
        try:
            answer = answer_of(status, content)
        except RemoteError as exc:
            raise remote_exception(exc) from None
        if handle.kind == "session":
            return answer.get("result")
        entries = answer.get("results") or []
        carriers = handle.carriers
        if carriers is None or len(carriers) != len(entries):
            from ..job import EMPTY, InvokeSpec
            cls = RemoteGeneration if handle.kind == "generate" else RemoteInvoke
            carriers = [cls(i, InvokeSpec(None, (), EMPTY, EMPTY, (), False)) for i in range(len(entries))]
        first = None
        for carrier, entry in zip(carriers, entries):
            carrier.deliver_remote(entry)
            if first is None and carrier.error is not None:
                first = carrier.error
        if handle.returns == "value":
            return carriers[0].result
        if first is not None and handle.returns != "invokes+":
            raise first
        return carriers[0] if handle.returns == "invoke" else list(carriers)

    def edit(self, fn, inplace: bool = False):
        """Persistent edits do not run on a remote model: add the function to every trace's invokes instead."""
        raise NotImplementedError("persistent edits (model.edit) do not run on a remote model: pass the edit as "
                                  "an intervention of the invokes it should change")

    def post_streamed(self, path: str, body: bytes):
        """POST ``body`` and read the answer as it streams (``with model.post_streamed(...) as r``): through
        :mod:`.job_post` where it behaves as httpx would, else through httpx."""
        if self.poster is not None:
            return self.poster.post(path, body, self.headers)
        return self.http.stream("POST", f"{self.url}{path}", content=body, headers=self.headers)

    def close(self) -> None:
        self.http.close()
        if self.poster is not None:
            self.poster.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<RemoteModel {self.url}>"


class RemoteEngine:
    """The engine of a remote model: checks invokes here, runs jobs on the server."""

    def __init__(self, model: RemoteModel, kind: str):
        self.model = model
        self.kind = kind

    def make_invoke(self, index, input, fns, kwargs, deferred) -> Invoke:
        cls = RemoteGeneration if self.kind == "generate" else RemoteInvoke
        inv = describe_invoke(index, input, fns, kwargs, deferred, cls)
        if self.model.check_modules:
            tree = self.model.tree()
            for fn in inv.fns:
                if not isinstance(fn, Named):
                    check_names(fn, tree)
        return inv

    def start(self, job) -> "RemoteExecution":
        return RemoteExecution(self.model, job)


class RemoteExecution:
    """One job sent to the server: ``wait()`` sends it and fills the result carriers."""

    output = None
    stopped = False

    def __init__(self, model: RemoteModel, job):
        self.model = model
        self.job = job
        self.done = False
        self.cancelled = False
        self._response = None

    def wait(self, cancellable: bool = False, on_event=None) -> None:
        model = self.model
        body = wire.packb({**model.versions, "job": dumps_job(self.job), "stream": True})
        model.info()   # the version check, once
        results = None
        try:
            with model.post_streamed("/v1/jobs", body) as r:
                self._response = r
                if self.cancelled:
                    raise RunCancelled("the remote job was cancelled")
                if r.status_code != 200:
                    try:
                        _decode_response(r.status_code, r.read())
                    except RemoteError as exc:
                        raise remote_exception(exc) from None
                unpacker = wire.stream_unpacker(wire.STREAM_ANSWER_LIMITS)
                leave = getattr(r, "leave", None)   # the lean path (job_post): the body's end is read later
                for chunk in r.iter_bytes():
                    unpacker.feed(chunk)
                    for obj in unpacker:
                        if not isinstance(obj, dict):
                            raise RemoteError("ProtocolError", f"unexpected stream item {obj!r:.200}")
                        event = obj.get("event")
                        if event == "error":
                            raise remote_exception(RemoteError.from_wire(obj.get("error"), obj.get("status")))
                        if event == "done":
                            results = obj.get("results")
                        elif on_event is not None:
                            on_event(obj)
                    if results is not None and leave is not None:
                        leave()
                        break
        except (httpx.HTTPError, OSError, http.client.HTTPException) as exc:
            if self.cancelled:
                raise RunCancelled("the remote job was cancelled") from None
            raise RemoteError("ConnectionError", f"the request to {model.url} failed: "
                                                 f"{exc or type(exc).__name__}") from None
        finally:
            self._response = None
        if self.cancelled:
            raise RunCancelled("the remote job was cancelled")
        carriers = self.job.results
        if not isinstance(results, list) or len(results) != len(carriers):
            raise RemoteError("ProtocolError", "the server's answer has no result for every invoke")
        first = None
        for carrier, entry in zip(carriers, results):
            carrier.deliver_remote(entry)
            if first is None and carrier.error is not None:
                first = carrier.error
        self.done = True
        if first is not None and self.job.on_error == "stop":
            raise first

    def cancel(self) -> None:
        """Thread-safe: close the request (the server cancels the job at its next hook point)."""
        self.cancelled = True
        r = self._response
        if r is not None:
            try:
                r.close()
            except Exception:  # noqa: BLE001 - closing from another thread may race the reader
                pass

    def cancel_invoke(self, index: int) -> None:
        self.cancel()


# --------------------------------------------------------------------------- results
class RemoteInvoke(Invoke):
    """An invoke of a remote trace: its result (or error) as the server sent it."""

    error = None
    _value = None

    def deliver_remote(self, entry) -> None:
        if not isinstance(entry, dict):
            entry = {"ok": False, "error": {"type": "ProtocolError", "message": "malformed result"}}
        if entry.get("ok"):
            self._value = fill_cache(self.spec.fns, entry.get("value"))   # an ai.Cache: filled with its records
        else:
            error = RemoteError.from_wire(entry.get("error"), entry.get("status"))
            if error.type == "UnsetFutureError":    # the usual cause: a value meant to flow from an earlier run
                error = RemoteError(error.type, error.message, error.remote_traceback, [*error.notes, _UNSET_HINT],
                                    error.status, error.kind)
            self.error = remote_exception(error)
        self.done = True

    def value(self):
        if self.error is not None:
            raise self.error
        return self._value


class RemoteGeneration(RemoteInvoke):
    """An invoke of a remote generation: ``.result``, ``.tokens`` (a LongTensor), ``.text``, ``.emitted``."""

    emitted = ()
    _tokens = None
    text = None
    stopped = False

    def deliver_remote(self, entry) -> None:
        super().deliver_remote(entry)
        if isinstance(entry, dict) and entry.get("ok"):
            self._tokens = entry.get("tokens")
            self.text = entry.get("text")
            self.emitted = list(entry.get("emitted") or [])

    @property
    def tokens(self):
        if not self.done:
            raise RuntimeError("the generation has not run yet")
        t = self._tokens
        if t and isinstance(t[0], list):
            return [torch.tensor(row, dtype=torch.long) for row in t]
        return torch.tensor(t or [], dtype=torch.long)

    def __repr__(self):
        return f"<RemoteGeneration {self.index} text={self.text!r}>" if self.done else \
            f"<RemoteGeneration {self.index} (not run)>"


# --------------------------------------------------------------------------- errors
_CLASSES = {}
_UNSET_HINT = ("A remote run sets the server's copies of your ai.Futures and variables, not yours: a value that "
               "an earlier remote run set does not reach a later run. Pass it between runs inside one session "
               "(`lm.session(fn)`, docs/remote.md \"Sessions\"), or set and await it in two invokes of one trace.")


def _session_result(status, content):
    try:
        return _decode_response(status, content)["result"]
    except RemoteError as exc:
        raise remote_exception(exc) from None


def remote_exception(exc: RemoteError) -> RemoteError:
    """``exc`` as an instance of its remote type too when that is a builtin or asyncinterp exception class."""
    base = getattr(builtins, exc.type, None) if exc.type and not exc.type.startswith("_") else None
    if base is None:
        base = getattr(kernel_errors, exc.type, None) if exc.type else None
    if exc.type == "VersionMismatch":
        base = VersionMismatch
    elif exc.type == "BadRequest":   # the server refused an input or option: a bad value, as locally
        base = ValueError
    if not (isinstance(base, type) and issubclass(base, Exception)) or issubclass(base, RemoteError):
        return exc
    cls = _CLASSES.get(base)
    if cls is None:
        try:
            cls = type(f"Remote{base.__name__}", (RemoteError, base), {"__module__": __name__})
        except TypeError:   # a layout that cannot be combined
            cls = RemoteError
        _CLASSES[base] = cls
    if cls is RemoteError:
        return exc
    out = cls.__new__(cls)
    out.__dict__.update(exc.__dict__)
    Exception.__init__(out, str(exc))
    return out
