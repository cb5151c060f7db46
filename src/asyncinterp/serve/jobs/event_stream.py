"""A streamed answer whose last event carries the end of the body with it (the native endpoints' and jobs').

Why a module of its own: a streamed answer (a remote job's, a native generation's) is a chunked HTTP body
of msgpack events, the last of which (``done``, or the error that ends it) is known to be the last when it
is made. Starlette's ``StreamingResponse`` writes the body's end as one more chunk after its iterator
stops: a second write that, after a large answer (a [1, vocab] tensor), waits for the client to drain the
first one, and a second read for the client, about half a millisecond on loopback. Here the stream marks
its last chunk (:class:`Final`) and :class:`EventStreamResponse` sends it with the body's end, one write.
It also watches the client's disconnect with :func:`~asyncinterp.aio.run_watched`, whose cancels cost no
formatting of a task's repr (:func:`~asyncinterp.aio.cancel_quietly`), where Starlette's task group pays two.
"""

from __future__ import annotations

import functools

from starlette.responses import StreamingResponse

from ... import aio
from ...client import wire
from . import errors
from ..sandbox import SandboxTimeout

__all__ = ["INTERVENTION_ERRORS", "EventStreamResponse", "Final", "stream_events"]

# what a request may fail with (an intervention may raise even SystemExit/KeyboardInterrupt: it must not
# take the server down); cancellation and GeneratorExit are not in this list and propagate
INTERVENTION_ERRORS = (Exception, SandboxTimeout, SystemExit, KeyboardInterrupt)


class Final:
    """The last chunk of a stream (its bytes in ``data``): nothing follows it."""

    __slots__ = ("data",)

    def __init__(self, data: bytes):
        self.data = data


async def stream_events(events, encode, encode_error, end_on_error=False, mark_final=False, first=None):
    """The body of a streaming answer: ``encode(event)`` for each event of a front's stream, ``encode_error(fail)``
    for a failure (the request's, or an event that cannot be encoded: the stream goes on after that unless
    ``end_on_error``, which cancels the request). ``mark_final``: the last chunk comes as :class:`Final`
    (for :class:`EventStreamResponse`); ``first``: an event already taken from ``events``, sent first."""
    last = Final if mark_final else bytes

    def chunk_of(ev):
        """What ``ev`` sends (``None``: nothing) and whether the stream ends with it."""
        try:
            chunk = encode(ev)
        except wire.WireError as exc:
            error = encode_error(errors.failure(exc))
            return (last(error) if end_on_error else error), end_on_error
        if not chunk:
            return None, False
        return (last(chunk) if ev.get("event") == "done" else chunk), False
    try:
        ev = first
        while True:
            if ev is None:
                try:
                    ev = await events.__anext__()
                except StopAsyncIteration:
                    return
            chunk, end = chunk_of(ev)
            ev = None
            if chunk is not None:
                yield chunk
            if end:
                return
    except INTERVENTION_ERRORS as exc:
        yield last(encode_error(errors.failure(exc)))
    finally:
        await events.aclose()


class EventStreamResponse(StreamingResponse):
    """A ``StreamingResponse`` that sends a :class:`Final` chunk together with the end of the body."""

    async def __call__(self, scope, receive, send) -> None:
        spec = tuple(map(int, scope.get("asgi", {}).get("spec_version", "2.0").split(".")))
        if scope["type"] != "http" or spec >= (2, 4):   # (2.4: a disconnect shows as a failed send)
            return await super().__call__(scope, receive, send)
        # as StreamingResponse: the body stops when the client goes away
        out = await aio.run_watched(functools.partial(self.stream_response, send),
                                    functools.partial(self.listen_for_disconnect, receive))
        if out.exc is not None:
            raise out.exc
        if self.background is not None:
            await self.background()

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            if isinstance(chunk, Final):
                await send({"type": "http.response.body", "body": chunk.data, "more_body": False})
                await self.body_iterator.aclose()
                return
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
