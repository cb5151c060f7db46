"""A clear answer when a replica dies under a request: runs in Ray Serve's HTTP proxy, around its app.

Why it exists: when the replica that accepted a request dies (crashed,
killed, its node lost), Ray Serve's proxy has nothing to send: before the
answer began, the client gets a bare ``500 Internal Server Error``; in the
middle of a stream, a connection closed without the stream's end. This
middleware wraps the proxy's ASGI app and turns both into the server's own
error shapes:

* nothing answered yet: ``502`` with the usual error body (msgpack
  ``{"ok": false, "error": {...}}`` on the native endpoints, OpenAI's JSON
  error on theirs), ``error.kind == "replica_lost"``, and
  ``x-should-retry: false`` (the ``openai`` client would otherwise retry a
  5xx on its own);
* a stream already under way: its error event (a msgpack ``error`` event,
  or a server-sent ``data: {"error": ...}`` then ``data: [DONE]``), then
  the end of the stream.

Nothing is retried: a request a replica accepted may have run (its
intervention may have had effects), so it never runs twice. Ray's router
itself resends only a request that no replica accepted (nothing of it ran).

The answers are built once, when the proxy starts, from the one table of
:mod:`.errors` (kind ``replica_lost``) and the shapes of
:mod:`.openai_compat`; the proxy imports this module by name.
"""

from __future__ import annotations

import json

KIND = "replica_lost"
MESSAGE = ("the replica serving this request stopped before it answered (it crashed, was killed, or its node was "
           "lost); the request was not retried, since it may already have run. Ray Serve starts a new replica; "
           "sending it again is safe only if running it twice is")
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/version",
                "/metrics")
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "asyncinterp.serve.scale.replica_loss:proxy_middlewares"


def proxy_middlewares() -> list:
    """Ray Serve's HTTP proxy callback: the proxy calls it at start when its process has
    ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=asyncinterp.serve.scale.replica_loss:proxy_middlewares``
    (set it where the head node starts; ``asyncinterp serve --replicas`` sets it for a local cluster)."""
    from starlette.middleware import Middleware
    return [Middleware(ReplicaLossAnswers)]


class Answers:
    """The bytes a lost replica's requests get: the server's own error shapes for kind ``replica_lost``."""

    def __init__(self, message: str = MESSAGE):
        from ..jobs import errors
        from ..openai import openai_compat
        from ...client import wire
        fail = errors.RequestFailed(KIND, message)
        self.status = fail.status
        self.error = fail.error
        self.headers = [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in (fail.headers or {}).items()]
        self.openai = openai_compat.error_body(fail.status, fail.error)
        self.native_body = wire.packb({"ok": False, "error": fail.error})
        self.openai_body = json.dumps(self.openai).encode()
        self.sse_tail = openai_compat.sse(self.openai) + openai_compat.DONE    # as a stream's own error ends
        self.msgpack_tail = wire.packb({"event": "error", "ok": False, "status": fail.status, "error": fail.error})

    def first(self, path: str) -> tuple:
        """``(content type, body)`` of the answer to a request to ``path`` that nothing was answered to yet."""
        if path.rstrip("/") in OPENAI_PATHS:
            return b"application/json", self.openai_body
        return b"application/msgpack", self.native_body

    def tail(self, content_type: str) -> bytes:
        """The end of a stream cut by a lost replica: its error event in the stream's own format."""
        if content_type.startswith("text/event-stream"):
            return self.sse_tail
        if content_type.startswith("application/x-msgpack-stream"):
            return self.msgpack_tail
        return b""      # a body of another kind has no in-band error: it ends, short, as before


class ReplicaLossAnswers:
    """ASGI middleware around Ray Serve's HTTP proxy app (installed by :func:`proxy_middlewares`)."""

    def __init__(self, app):
        self.app = app
        self.answers = Answers()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = {"started": False, "ended": False, "type": "", "gone": False}

        async def watched_receive():
            message = await receive()
            if message.get("type") == "http.disconnect":
                state["gone"] = True
            return message

        async def watched_send(message):
            kind = message["type"]
            if kind == "http.response.start":
                state["started"] = True
                for name, value in message.get("headers", []):
                    if name.lower() == b"content-type":
                        state["type"] = value.decode("latin-1").lower()
            elif kind == "http.response.body" and not message.get("more_body", False):
                state["ended"] = True
            await send(message)

        failed = None
        try:
            await self.app(scope, watched_receive, watched_send)
        except Exception as exc:  # noqa: BLE001 - answered below, then raised again for the proxy's logs
            failed = exc
        if not state["gone"] and not state["ended"]:
            await self._finish(scope, send, state)
        if failed is not None:
            raise failed

    async def _finish(self, scope, send, state) -> None:
        if not state["started"]:
            content_type, body = self.answers.first(scope.get("path", ""))
            await send({"type": "http.response.start", "status": self.answers.status,
                        "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode()),
                                    *self.answers.headers]})
            await send({"type": "http.response.body", "body": body, "more_body": False})
        else:
            await send({"type": "http.response.body", "body": self.answers.tail(state["type"]), "more_body": False})
