"""The HTTP front of a tensor-parallel model whose ranks run on Ray nodes: health while a rank is lost, and a relay.

``asyncinterp serve DIR --tensor-parallel-size N --ray-address ADDR``
(:mod:`.tp_ray`) runs the model's ranks as Ray actors on N nodes; rank 0
serves the usual HTTP app (:mod:`.tp_serve`) on its own node. This module
is what the command itself serves on ``--host``/``--port``: every request is
relayed to rank 0 as it is (bodies, headers, status, streamed answers), so
every endpoint — native, OpenAI-compatible, streams — behaves as on one
server. What it adds is the model's state:

* ``GET /v1/health`` answers 503 (``"status": "unavailable"``, with the
  reason) while the ranks are starting, while a rank is lost and until the
  model is back on enough nodes; 200 with rank 0's own health and where each
  rank runs (``tensor_parallel``) once they all answer;
* a request arriving while the model is not there gets 503 ``ranks_lost``
  (``Retry-After``) at once, in the server's error shape (msgpack on the
  native endpoints, OpenAI's JSON on the OpenAI ones);
* a request that was running when a rank was lost (rank 0 answers with a
  failed collective, or cannot be reached) gets 503 ``ranks_lost`` naming
  the lost rank and its node, with rank 0's own error appended. Other errors
  of rank 0 pass through unchanged, at once.

Every wait is bounded: the relay's connect/read timeouts follow the
server's ``--timeout``, and an error that looks like a failed collective
waits at most ``LOSS_WAIT`` seconds for the supervisor to tell a lost rank
from a rank's own failure.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..http.app import _OPENAI_PATHS, _error_response, _lifespan, _openai_error_response
from ..jobs.errors import RequestFailed, status_of

__all__ = ["RankState", "front_app", "LOSS_WAIT"]

#: seconds a failed collective on rank 0 waits for the supervisor to say whether a rank was lost under it
LOSS_WAIT = 5.0
UNAVAILABLE = status_of("ranks_lost")
FAILED = status_of("intervention")          # from this status up, rank 0's error may be a collective a lost rank broke
#: words of a failed collective (a peer gone, a rank that did not report) in rank 0's error message
_COLLECTIVE_WORDS = ("RankFailedError", "gloo", "Gloo", "Connection closed", "Connection reset", "peer",
                     "did not report", "timed out", "Timed out")
_HOP = {b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"upgrade"}


class RankState:
    """Where the model's ranks stand, shared by the supervisor (a thread) and the front (the event loop)."""

    def __init__(self, nproc: int):
        self.lock = threading.Lock()
        self.nproc = nproc
        self.status = "starting"          # starting | ready | lost | waiting | stopped
        self.reason = "the ranks are starting"
        self.upstream = None              # rank 0's URL while ready
        self.nodes = []                   # per rank: its Ray node id and address
        self.generation = 0               # +1 each time the ranks become ready
        self.losses = 0
        self.last_loss = None
        self.since = time.time()

    def set(self, status: str, reason: str, upstream=None, nodes=None) -> None:
        with self.lock:
            if status == "lost" and self.status != "lost":
                self.losses += 1
                self.last_loss = reason
            if status == "ready":
                self.generation += 1
            self.status, self.reason, self.upstream = status, reason, upstream if status == "ready" else None
            if nodes is not None:
                self.nodes = [{"rank": r, "node_id": n["node_id"], "ip": n["ip"]} for r, n in enumerate(nodes)]
            self.since = time.time()

    def snapshot(self) -> dict:
        with self.lock:
            return {"status": self.status, "reason": self.reason, "upstream": self.upstream,
                    "generation": self.generation, "nodes": list(self.nodes), "losses": self.losses,
                    "last_loss": self.last_loss, "since": self.since}

    def describe(self) -> dict:
        s = self.snapshot()
        return {"size": self.nproc, "placement": "ray", "status": s["status"], "ranks": s["nodes"],
                "losses": s["losses"], **({"reason": s["reason"]} if s["status"] != "ready" else {})}

    async def lost_after(self, generation: int, wait: float) -> bool:
        """Whether the ranks of ``generation`` are (found within ``wait`` s to be) gone."""
        deadline = time.monotonic() + wait
        while True:
            s = self.snapshot()
            if s["generation"] != generation or s["status"] != "ready":
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.1)


def _unavailable(request: Request, message: str) -> Response:
    fail = RequestFailed("ranks_lost", message)
    render = _openai_error_response if request.url.path.rstrip("/") in _OPENAI_PATHS else _error_response
    return render(fail)


def front_app(state: RankState, name: str, timeout: float) -> Starlette:
    """The command's own app: ``/v1/health`` from ``state``, every other path relayed to rank 0."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(connect=5.0, read=timeout + 60.0, write=60.0, pool=10.0))

    def not_there(s) -> str:
        return (f"the tensor-parallel model {name!r} is not available: {s['reason']}. Its ranks are restarted "
                "automatically once the cluster has the nodes; retry later (GET /v1/health says when)")

    async def health(request: Request) -> Response:
        s = state.snapshot()
        if s["status"] == "ready":
            try:
                r = await client.get(s["upstream"] + "/v1/health", timeout=5.0)
                body = r.json()
                if r.status_code == 200:
                    return JSONResponse({**body, "tensor_parallel": state.describe()})
                reason = f"rank 0 answered its health check with HTTP {r.status_code}"
            except (httpx.HTTPError, ValueError) as exc:
                reason = f"rank 0 does not answer ({type(exc).__name__})"
            return JSONResponse({"status": "unavailable", "model": name, "reason": reason,
                                 "tensor_parallel": state.describe()}, UNAVAILABLE, {"Retry-After": "1"})
        return JSONResponse({"status": "unavailable", "model": name, "reason": s["reason"],
                             "tensor_parallel": state.describe()}, UNAVAILABLE, {"Retry-After": "1"})

    async def relay(request: Request) -> Response:
        s = state.snapshot()
        if s["status"] != "ready":
            return _unavailable(request, not_there(s))
        body = await request.body()
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in _HOP]
        url = s["upstream"] + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        try:
            upstream = await client.send(client.build_request(request.method, url, headers=headers, content=body),
                                         stream=True)
        except httpx.HTTPError as exc:
            if await state.lost_after(s["generation"], LOSS_WAIT):
                return _unavailable(request, "a rank of the tensor-parallel model was lost while this request "
                                             f"ran; {not_there(state.snapshot())} ({type(exc).__name__})")
            return _unavailable(request, f"rank 0 of the tensor-parallel model could not be reached: "
                                         f"{type(exc).__name__}: {exc}")
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower().encode() not in _HOP}
        if upstream.status_code >= FAILED:
            content = await upstream.aread()
            await upstream.aclose()
            detail = _error_text(content)
            if _collective_failure(detail) and await state.lost_after(s["generation"], LOSS_WAIT):
                return _unavailable(request, "a rank of the tensor-parallel model was lost while this request ran; "
                                             + not_there(state.snapshot())
                                             + f". Rank 0 answered HTTP {upstream.status_code}: {detail}")
            return Response(content, upstream.status_code, out_headers)
        return StreamingResponse(upstream.aiter_raw(), status_code=upstream.status_code, headers=out_headers,
                                 background=BackgroundTask(upstream.aclose))

    async def shutdown():
        await client.aclose()

    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
    routes = [Route("/v1/health", health, methods=["GET"]), Route("/{path:path}", relay, methods=methods)]
    return Starlette(routes=routes, lifespan=_lifespan(shutdown))


def _collective_failure(detail: str) -> bool:
    return any(w in detail for w in _COLLECTIVE_WORDS)


def _error_text(content: bytes) -> str:
    """The message in rank 0's error answer (msgpack or JSON), else its first bytes as text."""
    from ...client import wire
    try:
        obj = wire.unpackb(content)
    except Exception:  # noqa: BLE001 - not msgpack: JSON or text
        import json
        try:
            obj = json.loads(content)
        except ValueError:
            return content[:300].decode("utf-8", "replace")
    err = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(err, dict):
        return ""
    return f"{err.get('type', 'Error')}: {err.get('message', '')}"[:1000]
