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

The proxy imports this module by name, so it imports neither torch nor Ray:
the shapes below are those of :mod:`.errors` (a test checks they agree).
"""

from __future__ import annotations

import json

import msgpack

KIND = "replica_lost"
STATUS = 502
TYPE = "ReplicaLost"
MESSAGE = ("the replica serving this request stopped before it answered (it crashed, was killed, or its node was "
           "lost); the request was not retried, since it may already have run. Ray Serve starts a new replica; "
           "sending it again is safe only if running it twice is")
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/version",
                "/metrics")


def error_map(message: str = MESSAGE) -> dict:
    """The ``error`` map of the server's answers (:class:`~.errors.RequestFailed`'s shape)."""
    return {"type": TYPE, "message": message, "traceback": [], "notes": [], "kind": KIND}


def openai_error(message: str = MESSAGE) -> dict:
    """OpenAI's error shape (:func:`~.openai_compat.error_body`'s) for a lost replica."""
    error = error_map(message)
    return {"error": {"message": message, "type": "server_error", "param": None, "code": KIND,
                      "asyncinterp": {k: error[k] for k in ("type", "traceback", "notes", "kind")}}}


def answer(path: str) -> tuple:
    """``(content type, body)`` of the 502 for a request to ``path`` that nothing was answered to yet."""
    if path.rstrip("/") in OPENAI_PATHS:
        return b"application/json", json.dumps(openai_error()).encode()
    return b"application/msgpack", msgpack.packb({"ok": False, "error": error_map()})


def stream_tail(content_type: str) -> bytes:
    """The end of a stream cut by a lost replica: its error event in the stream's own format."""
    if content_type.startswith("text/event-stream"):
        return b"data: " + json.dumps(openai_error(), separators=(",", ":")).encode() + b"\n\ndata: [DONE]\n\n"
    if content_type.startswith("application/x-msgpack-stream"):
        return msgpack.packb({"event": "error", "ok": False, "status": STATUS, "error": error_map()})
    return b""      # a body of another kind has no in-band error: it ends, short, as before


PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "asyncinterp.serve.replica_loss:proxy_middlewares"


def proxy_middlewares() -> list:
    """Ray Serve's HTTP proxy callback: the proxy calls it at start when its process has
    ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=asyncinterp.serve.replica_loss:proxy_middlewares``
    (set it where the head node starts; ``asyncinterp serve --replicas`` sets it for a local cluster)."""
    from starlette.middleware import Middleware
    return [Middleware(ReplicaLossAnswers)]


class ReplicaLossAnswers:
    """ASGI middleware around Ray Serve's HTTP proxy app (installed by :func:`proxy_middlewares`)."""

    def __init__(self, app):
        self.app = app

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

    @staticmethod
    async def _finish(scope, send, state) -> None:
        if not state["started"]:
            content_type, body = answer(scope.get("path", ""))
            await send({"type": "http.response.start", "status": STATUS,
                        "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode()),
                                    (b"x-should-retry", b"false")]})
            await send({"type": "http.response.body", "body": body, "more_body": False})
        else:
            await send({"type": "http.response.body", "body": stream_tail(state["type"]), "more_body": False})
