"""The ASGI app a server's own uvicorn runs: ``POST /v1/jobs`` straight to its handler, the rest to Starlette.

Why a module of its own: every remote trace (``ai.remote``) is one ``POST /v1/jobs``. On that path
Starlette's error middleware, exception middleware, router and request wrapper cost about 0.2 ms a request
when the caches are cold (a forward ran since the last request; ``benchmarks/remote_roundtrip.py``), and give
it nothing: its handler answers every failure itself (``Server._guarded``: auth, bad bodies, refusals and
internal errors all become error answers). Every other request, and any request under a root path (a
mounted app), goes through the Starlette app (``Server.app``) as before.
"""

from __future__ import annotations

from starlette.requests import Request

__all__ = ["DirectJobs"]


class DirectJobs:
    """``app`` (the server's Starlette app) with ``POST /v1/jobs`` answered by ``handler(request)`` directly."""

    __slots__ = ("app", "handler")

    def __init__(self, app, handler):
        self.app = app
        self.handler = handler

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/jobs" and scope["method"] == "POST" \
                and not scope.get("root_path"):
            scope["app"] = self.app       # (as Starlette sets it: request.app)
            response = await self.handler(Request(scope, receive, send))
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
