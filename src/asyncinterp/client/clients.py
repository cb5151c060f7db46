"""HTTP clients for an asyncinterp server, mirroring local ``trace``/``generate``.

    client = ai.serve.Client("http://127.0.0.1:8000", api_key="secret")
    top = client.trace("The Eiffel Tower is in", "top_k", k=5)           # a registered intervention

    async def last(m):                                                    # your own (server needs --allow-code)
        return (await m.model.layers[3].output)[:, -1]
    h = client.trace("The Eiffel Tower is in", last)

    gen = client.generate("Once upon a time", "steer", module="model.layers.3", vector=v, max_new_tokens=20)
    for event in client.stream_generate("Once upon a time", max_new_tokens=20):
        ...

``AsyncClient`` has the same methods as coroutines (``stream_generate`` is an
async iterator). An intervention is a registered name, an ``async def``
function (its source is sent; it must be self-contained: imports inside the
function, no closures), a ``functools.partial`` of one (its keywords become
parameters), or source text. Errors raised on the server come back as
:class:`~asyncinterp.client.wire.RemoteError` with the remote type, message
and the intervention's own traceback lines.

The client loads no server module (``tests/test_remote_install.py``): it
imports the wire format, the capture of functions and the job's writing
side only; :func:`session_body` (a session's request body) lives here for
that reason.
"""

from __future__ import annotations

import functools
import inspect
import textwrap
from dataclasses import dataclass, field

import httpx

from . import wire
from .capture import Capture
from .sources import source_text
from .wire import RemoteError

MSGPACK = "application/msgpack"


@dataclass
class Generated:
    """A generation's answer: the intervention's result, the tokens and text, the emitted values."""

    result: object
    tokens: list
    text: str
    emitted: list = field(default_factory=list)
    receipt: dict | None = None     # what computed it (the server's receipt, see asyncinterp.serve.openai.receipts)


def intervention_spec(intervention, params: dict | None = None) -> dict | None:
    """The wire form of an intervention argument (name, function, partial or source text)."""
    params = dict(params or {})
    if intervention is None:
        if params:
            raise TypeError("parameters given but no intervention")
        return None
    if isinstance(intervention, functools.partial):
        if intervention.args:
            raise TypeError("a partial intervention may bind keywords only (they are sent as parameters)")
        params = {**intervention.keywords, **params}
        intervention = intervention.func
    if isinstance(intervention, str):
        if "async def" in intervention or "\n" in intervention:
            return {"source": textwrap.dedent(intervention), "params": params}
        return {"name": intervention, "params": params}
    if inspect.iscoroutinefunction(intervention):
        try:
            source = source_text(intervention)
        except (OSError, TypeError) as exc:
            raise TypeError(f"cannot get the source of {intervention!r} to send it ({exc}); pass the source "
                            "text instead") from None
        if intervention.__code__.co_freevars:
            raise TypeError(f"{intervention.__name__} uses variables of an enclosing function "
                            f"({', '.join(intervention.__code__.co_freevars)}); submitted interventions must be "
                            "self-contained: pass values as parameters")
        return {"source": source, "entry": intervention.__name__, "params": params}
    raise TypeError(f"an intervention must be a registered name, an async def function, a partial of one or "
                    f"source text, got {intervention!r}")


def _body(input, intervention, params, timeout, extra=None):
    obj = {"input": input}
    spec = intervention_spec(intervention, params)
    if spec is not None:
        obj["intervention"] = spec
    if timeout is not None:
        obj["timeout"] = timeout
    if extra:
        obj.update(extra)
    return wire.packb(obj)


def _decode_response(status, content):
    try:
        obj = wire.unpackb(content, wire.answer_limits(len(content)))
    except wire.WireError:
        text = content[:500].decode("utf-8", "replace")
        raise RemoteError("HTTPError", f"HTTP {status}: {text}", status=status) from None
    if status == 200 and isinstance(obj, dict) and obj.get("ok"):
        return obj
    if isinstance(obj, dict) and "error" in obj:
        raise RemoteError.from_wire(obj["error"], status)
    raise RemoteError("HTTPError", f"HTTP {status}: unexpected answer", status=status)


def _generated(obj) -> Generated:
    return Generated(obj.get("result"), obj.get("tokens"), obj.get("text"), obj.get("emitted") or [],
                     obj.get("receipt"))


def _event(obj):
    if not isinstance(obj, dict):
        raise RemoteError("ProtocolError", f"unexpected stream item {obj!r:.200}")
    if obj.get("event") == "error":
        raise RemoteError.from_wire(obj.get("error"), obj.get("status"))
    if obj.get("event") == "done":
        return {"event": "done", "result": _generated(obj)}
    return obj


class _Base:
    def __init__(self, url: str, api_key: str | None = None, timeout: float = 120.0):
        self.url = url.rstrip("/")
        self.headers = {"content-type": MSGPACK, "accept": MSGPACK}
        if api_key:
            self.headers["authorization"] = f"Bearer {api_key}"
        self.timeout = timeout

    def _http_timeout(self, timeout):
        return httpx.Timeout(self.timeout if timeout is None else timeout + 10.0, connect=10.0)


class Client(_Base):
    """Synchronous client (httpx). Use as a context manager or call :meth:`close`."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 120.0, **httpx_kwargs):
        super().__init__(url, api_key, timeout)
        self._http = httpx.Client(timeout=self._http_timeout(None), **httpx_kwargs)

    def trace(self, input, intervention, *, params: dict | None = None, timeout: float | None = None, **kw):
        """Run ``intervention`` on ``input`` on the server; returns its result (tensors as torch tensors)."""
        body = _body(input, intervention, {**(params or {}), **kw}, timeout)
        r = self._http.post(f"{self.url}/v1/trace", content=body, headers=self.headers,
                            timeout=self._http_timeout(timeout))
        return _decode_response(r.status_code, r.content)["result"]

    def generate(self, input, intervention=None, *, max_new_tokens: int = 20, params: dict | None = None,
                 timeout: float | None = None, **kw) -> Generated:
        body = _body(input, intervention, {**(params or {}), **kw}, timeout, {"max_new_tokens": max_new_tokens})
        r = self._http.post(f"{self.url}/v1/generate", content=body, headers=self.headers,
                            timeout=self._http_timeout(timeout))
        return _generated(_decode_response(r.status_code, r.content))

    def stream_generate(self, input, intervention=None, *, max_new_tokens: int = 20, params: dict | None = None,
                        timeout: float | None = None, **kw):
        """Iterate over ``token``/``emit`` events as the server produces them, then a ``done`` event."""
        body = _body(input, intervention, {**(params or {}), **kw}, timeout,
                     {"max_new_tokens": max_new_tokens, "stream": True})
        with self._http.stream("POST", f"{self.url}/v1/generate", content=body, headers=self.headers,
                               timeout=self._http_timeout(timeout)) as r:
            if r.status_code != 200:
                _decode_response(r.status_code, r.read())
            unpacker = wire.stream_unpacker(wire.STREAM_ANSWER_LIMITS)
            for chunk in r.iter_bytes():
                unpacker.feed(chunk)
                for obj in unpacker:
                    yield _event(obj)

    def session(self, fn, *, timeout: float | None = None):
        """Run ``fn`` (``async def fn(model)`` calling ``await model.atrace(...)``) on the server as one job;
        returns its result (see :mod:`asyncinterp.serve.jobs.sessions`). The same function runs locally: ``await fn(lm)``."""
        r = self._http.post(f"{self.url}/v1/sessions", content=session_body(fn, timeout), headers=self.headers,
                            timeout=self._http_timeout(timeout))
        return _decode_response(r.status_code, r.content)["result"]

    def model_info(self) -> dict:
        r = self._http.get(f"{self.url}/v1/model", headers=self.headers)
        if r.status_code != 200:
            raise RemoteError.from_wire(r.json().get("error"), r.status_code)
        return r.json()

    def health(self) -> dict:
        return self._http.get(f"{self.url}/v1/health").json()

    def close(self):
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncClient(_Base):
    """Asynchronous client (httpx.AsyncClient); works under asyncio and trio."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 120.0, **httpx_kwargs):
        super().__init__(url, api_key, timeout)
        self._http = httpx.AsyncClient(timeout=self._http_timeout(None), **httpx_kwargs)

    async def trace(self, input, intervention, *, params: dict | None = None, timeout: float | None = None, **kw):
        body = _body(input, intervention, {**(params or {}), **kw}, timeout)
        r = await self._http.post(f"{self.url}/v1/trace", content=body, headers=self.headers,
                                  timeout=self._http_timeout(timeout))
        return _decode_response(r.status_code, r.content)["result"]

    async def generate(self, input, intervention=None, *, max_new_tokens: int = 20, params: dict | None = None,
                       timeout: float | None = None, **kw) -> Generated:
        body = _body(input, intervention, {**(params or {}), **kw}, timeout, {"max_new_tokens": max_new_tokens})
        r = await self._http.post(f"{self.url}/v1/generate", content=body, headers=self.headers,
                                  timeout=self._http_timeout(timeout))
        return _generated(_decode_response(r.status_code, r.content))

    async def stream_generate(self, input, intervention=None, *, max_new_tokens: int = 20,
                              params: dict | None = None, timeout: float | None = None, **kw):
        body = _body(input, intervention, {**(params or {}), **kw}, timeout,
                     {"max_new_tokens": max_new_tokens, "stream": True})
        async with self._http.stream("POST", f"{self.url}/v1/generate", content=body, headers=self.headers,
                                     timeout=self._http_timeout(timeout)) as r:
            if r.status_code != 200:
                _decode_response(r.status_code, await r.aread())
            unpacker = wire.stream_unpacker(wire.STREAM_ANSWER_LIMITS)
            async for chunk in r.aiter_bytes():
                unpacker.feed(chunk)
                for obj in unpacker:
                    yield _event(obj)

    async def session(self, fn, *, timeout: float | None = None):
        """:meth:`Client.session` as a coroutine (cancelling it stops the session on the server)."""
        r = await self._http.post(f"{self.url}/v1/sessions", content=session_body(fn, timeout),
                                  headers=self.headers, timeout=self._http_timeout(timeout))
        return _decode_response(r.status_code, r.content)["result"]

    async def model_info(self) -> dict:
        r = await self._http.get(f"{self.url}/v1/model", headers=self.headers)
        if r.status_code != 200:
            raise RemoteError.from_wire(r.json().get("error"), r.status_code)
        return r.json()

    async def health(self) -> dict:
        return (await self._http.get(f"{self.url}/v1/health")).json()

    async def aclose(self):
        await self._http.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()


def session_body(fn, timeout: float | None = None) -> bytes:
    """The request body that runs ``fn`` (an ``async def`` taking the model) as a session on a server."""
    capture = Capture()
    try:
        spec = capture.add_intervention(fn)
    except TypeError as exc:
        raise TypeError(f"this session cannot travel: {exc}") from None
    body = {"capture": capture.description(), "session": spec}
    if timeout is not None:
        body["timeout"] = timeout
    return wire.packb(body)
