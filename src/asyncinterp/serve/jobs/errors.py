"""How a request's failure becomes an HTTP answer: the one table from exception to status, for every front.

Why this module exists: the same failure must get the same answer wherever
it surfaces: the native msgpack endpoints, the OpenAI-compatible ones, an
error event in the middle of a stream, or a worker process that reports the
failure to the server (:mod:`.worker_proc`). Each of them asks this module;
none keeps a mapping of its own.

Two tables:

* :data:`KINDS`: an error's ``kind`` (what clients branch on, ``error.kind``)
  -> its HTTP status, the ``type`` a plain message of the server carries,
  and headers the answer needs (``Retry-After``, ``WWW-Authenticate``);
* :data:`RULES`: an exception class -> its kind (first match wins; anything
  else an intervention raised is ``intervention``, 422).

:data:`OPENAI_TYPES` gives the OpenAI error ``type`` of each status.
Refusals decided by the server itself (a malformed body, a wrong key) are
raised as :class:`RequestFailed` with their kind.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...client import wire
from ..scheduling.batcher import BatcherClosed, BatcherFull
from ..sandbox import SandboxTimeout
from ..scheduling.worker_failures import (RemoteFailure, WorkerFailure, WorkerHung, WorkerOutOfMemory, WorkerOverran,
        WorkerUnavailable)


@dataclass(frozen=True)
class Kind:
    """What the server answers for one kind of error.

    ``type``: the error's ``type`` when the answer is a message of the
    server's (not an exception's); ``headers``: ``(name, value)`` pairs
    added to the answer.
    """

    status: int
    type: str = "Error"
    headers: tuple = ()


RETRY_SOON = (("Retry-After", "1"),)

KINDS = {
    "request": Kind(400, "BadRequest"),            # malformed body, unknown field, invalid input or parameters
    "refused": Kind(400, "SandboxRefused"),        # submitted code refused, or not accepted at all
    "auth": Kind(401, "Unauthorized", (("WWW-Authenticate", "Bearer"),)),
    "not_found": Kind(404, "NotFound"),            # unknown route or model (405 for a wrong method)
    "too_large": Kind(413, "PayloadTooLarge"),
    "intervention": Kind(422),                     # the intervention raised, or its result cannot be encoded
    "client_disconnect": Kind(499, "Cancelled"),   # logged only: nobody is left to read the answer
    "internal": Kind(500, "InternalError"),
    "crashed": Kind(500),                          # process isolation: the worker died running it alone
    "overloaded": Kind(503, "Overloaded", RETRY_SOON),
    "closed": Kind(503, "Closed", RETRY_SOON),
    # Ray Serve: the replica died under it (answered by .replica_loss); never retried, as it may have run
    "replica_lost": Kind(502, "ReplicaLost", (("x-should-retry", "false"),)),
    "unavailable": Kind(503),                      # process isolation: no worker could be started
    # tensor parallel on Ray nodes: a rank was lost (its node left); the model comes back by itself (.tp_front)
    "ranks_lost": Kind(503, "RanksLost", RETRY_SOON),
    "timeout": Kind(504, "Timeout"),               # the request's time limit or its compute budget
    "hung": Kind(504),                             # process isolation: no heartbeat while running it alone
    "overran": Kind(504),                          # process isolation: past its batch's hard deadline
    "out_of_memory": Kind(507),                    # process isolation: past the worker's memory limit
}

TIME_LIMIT_REACHED = "the request's time limit was reached; its intervention was closed"


@dataclass(frozen=True)
class Rule:
    """How a failure of one exception class is answered.

    ``plain``: the answer is a message of the server's (``message``, else
    the exception's text) with no exception type or traceback: the
    condition is the server's, not the intervention's.
    """

    exception: type
    kind: str
    plain: bool = False
    message: str | None = None


RULES = (
    Rule(WorkerHung, "hung"),
    Rule(WorkerOverran, "overran"),
    Rule(WorkerOutOfMemory, "out_of_memory"),
    Rule(WorkerUnavailable, "unavailable"),
    Rule(WorkerFailure, "crashed"),
    Rule(BatcherFull, "overloaded", plain=True),
    Rule(BatcherClosed, "closed", plain=True),
    Rule(SandboxTimeout, "timeout"),            # its own reason: the compute budget or the time limit, and where
    Rule(TimeoutError, "timeout", plain=True, message=TIME_LIMIT_REACHED),
)
INTERVENTION_RAISED = Rule(BaseException, "intervention")

OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                422: "intervention_error", 499: "client_disconnect", 503: "overloaded_error", 504: "timeout_error"}


def status_of(kind: str) -> int:
    """The HTTP status of an error of ``kind``."""
    return KINDS[kind].status


def rule_for(exc: BaseException) -> Rule:
    """The first rule whose exception class ``exc`` is an instance of (else :data:`INTERVENTION_RAISED`)."""
    for rule in RULES:
        if isinstance(exc, rule.exception):
            return rule
    return INTERVENTION_RAISED


def openai_type(status: int) -> str:
    """OpenAI's error ``type`` for an answer with ``status``."""
    return OPENAI_TYPES.get(status, "server_error")


def openai_headers(status: int, headers=None) -> dict:
    """The headers of an OpenAI-shaped error answer: the server's, and whether the ``openai`` client retries."""
    out = dict(headers or {})
    if status == 504:
        out["x-should-retry"] = "false"   # its own time limit or code budget: the same request would fail again
    return out


class RequestFailed(Exception):
    """The answer to a request that failed: ``status``, ``kind``, the ``error`` map, ``headers``, ``param``.

    ``exc_or_msg``: the exception the request failed with (its type,
    message and own traceback lines go to the client) or a message of the
    server's. ``status`` and ``headers`` default to those of ``kind``;
    ``param`` names the request field at fault, when known (OpenAI errors
    name it).
    """

    def __init__(self, kind: str, exc_or_msg, *, status: int | None = None, headers=None, param=None):
        known = KINDS.get(kind, Kind(500))
        self.status = known.status if status is None else status
        self.kind = kind
        self.headers = dict(known.headers) if headers is None and known.headers else headers
        self.param = param
        if isinstance(exc_or_msg, BaseException):
            self.error = wire.encode_error(exc_or_msg, kind)
        else:
            self.error = {"type": known.type, "message": wire.excerpt(exc_or_msg), "traceback": [], "notes": [],
                          "kind": kind}
        super().__init__(self.error["message"])


def failure(exc: BaseException) -> RequestFailed:
    """The server's answer to a request that failed with ``exc``."""
    if isinstance(exc, RequestFailed):
        return exc
    if isinstance(exc, RemoteFailure):   # a worker process answered it already (with this table)
        return RequestFailed(exc.kind, exc, status=exc.status)
    rule = rule_for(exc)
    if rule.plain:
        return RequestFailed(rule.kind, rule.message or str(exc))
    return RequestFailed(rule.kind, exc)


def routing_failure(status: int, message: str) -> RequestFailed:
    """The answer to a request the router turned away with ``status`` (404: no such route, 405: wrong method)."""
    return RequestFailed("not_found" if status in (404, 405) else "request", message, status=status)


def checked_status(status: int) -> int:
    """A status that a worker process reported for a failure: kept if it is an HTTP error status, else 500."""
    return status if 400 <= status < 600 else KINDS["internal"].status


def reported(exc: BaseException) -> tuple:
    """``(status, error map)`` that a worker process reports to the server for a request that failed with ``exc``.

    The same status and kind as :func:`failure`; the map keeps the
    exception's own type and traceback lines even where the server's answer
    would be a plain message (what the server then sends on as it is).
    """
    if isinstance(exc, RequestFailed):   # the server's checks refused it (run again in the worker)
        return exc.status, exc.error
    rule = rule_for(exc)
    error = wire.encode_error(exc, rule.kind)
    if rule.message:
        error["message"] = rule.message
    return status_of(rule.kind), error
