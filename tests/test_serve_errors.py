"""One table from exception to HTTP status (serve/jobs/errors.py): every failure maps to the status the HTTP tests
expect, the worker reports what the server would answer, and no other serving module keeps a mapping."""

import ast
import pathlib

import pytest

from asyncinterp.serve import errors, wire
from asyncinterp.serve.scheduling.batcher import BatcherClosed, BatcherFull
from asyncinterp.serve.jobs.errors import RequestFailed
from asyncinterp.serve.sandbox import SandboxTimeout
from asyncinterp.serve.workers.supervisor import (RemoteFailure, WorkerCrashed, WorkerFailure, WorkerHung, WorkerOutOfMemory,
                                          WorkerOverran, WorkerUnavailable)

SERVE = pathlib.Path(__file__).resolve().parent.parent / "src" / "asyncinterp" / "serve"

# (exception, status, kind, error type in the answer, headers): what tests/test_serve_*.py see over HTTP
EXPECTED = [
    (WorkerHung("no progress"), 504, "hung", "WorkerHung", None),
    (WorkerOverran("past its deadline"), 504, "overran", "WorkerOverran", None),
    (WorkerCrashed("SIGSEGV"), 500, "crashed", "WorkerCrashed", None),
    (WorkerOutOfMemory("out of memory"), 507, "out_of_memory", "WorkerOutOfMemory", None),
    (WorkerUnavailable("failed to start"), 503, "unavailable", "WorkerUnavailable", None),
    (WorkerFailure("any other"), 500, "crashed", "WorkerFailure", None),
    (BatcherFull("queue full"), 503, "overloaded", "Overloaded", {"Retry-After": "1"}),
    (BatcherClosed("shutting down"), 503, "closed", "Closed", {"Retry-After": "1"}),
    (SandboxTimeout("compute budget"), 504, "timeout", "SandboxTimeout", None),
    (TimeoutError(), 504, "timeout", "Timeout", None),
    (ValueError("bad"), 422, "intervention", "ValueError", None),
    (IndexError("out of bounds"), 422, "intervention", "IndexError", None),
    (SystemExit(3), 422, "intervention", "SystemExit", None),
    (KeyboardInterrupt(), 422, "intervention", "KeyboardInterrupt", None),
    (wire.WireError("cannot encode"), 422, "intervention", "WireError", None),
]


@pytest.mark.parametrize("exc, status, kind, type_, headers", EXPECTED, ids=lambda v: type(v).__name__)
def test_each_failure_maps_to_its_status(exc, status, kind, type_, headers):
    fail = errors.failure(exc)
    assert (fail.status, fail.kind, fail.error["type"], fail.error["kind"]) == (status, kind, type_, kind)
    assert fail.headers == headers


@pytest.mark.parametrize("exc, status, kind, type_, headers", EXPECTED, ids=lambda v: type(v).__name__)
def test_a_worker_reports_the_status_and_kind_the_server_answers(exc, status, kind, type_, headers):
    reported_status, error = errors.reported(exc)
    assert (reported_status, error["kind"]) == (status, kind)
    # the server passes a worker's report on as it is
    relayed = errors.failure(RemoteFailure(reported_status, error))
    assert (relayed.status, relayed.kind, relayed.error) == (status, kind, error)


def test_time_limit_message_and_refusals():
    assert errors.failure(TimeoutError()).error["message"] == errors.TIME_LIMIT_REACHED
    assert errors.reported(TimeoutError())[1]["message"] == errors.TIME_LIMIT_REACHED
    refused = RequestFailed("refused", "import of 'os' is not allowed")
    assert errors.failure(refused) is refused and errors.reported(refused) == (400, refused.error)
    assert refused.error == {"type": "SandboxRefused", "message": "import of 'os' is not allowed", "traceback": [],
                             "notes": [], "kind": "refused"}
    auth = RequestFailed("auth", "invalid API key")
    assert auth.status == 401 and auth.headers == {"WWW-Authenticate": "Bearer"}
    assert RequestFailed("not_found", "no such route", status=405).status == 405
    assert [errors.routing_failure(s, "x").kind for s in (404, 405, 400)] == ["not_found", "not_found", "request"]
    assert errors.checked_status(504) == 504 and errors.checked_status(200) == 500


def test_statuses_of_kinds_and_openai_types():
    statuses = {k: v.status for k, v in errors.KINDS.items()}
    assert statuses == {"request": 400, "refused": 400, "auth": 401, "not_found": 404, "too_large": 413,
                        "intervention": 422, "client_disconnect": 499, "internal": 500, "crashed": 500,
                        "overloaded": 503, "closed": 503, "unavailable": 503, "timeout": 504, "hung": 504,
                        "overran": 504, "out_of_memory": 507, "replica_lost": 502,
                        "ranks_lost": 503}
    assert [errors.openai_type(s) for s in (400, 401, 404, 405, 413, 422, 500, 503, 504, 507)] == [
        "invalid_request_error", "authentication_error", "not_found_error", "invalid_request_error",
        "invalid_request_error", "intervention_error", "server_error", "overloaded_error", "timeout_error",
        "server_error"]
    assert errors.openai_headers(504, {"a": "b"}) == {"a": "b", "x-should-retry": "false"}
    assert errors.openai_headers(503, {"Retry-After": "1"}) == {"Retry-After": "1"}


def test_every_rule_names_a_known_kind():
    for rule in errors.RULES + (errors.INTERVENTION_RAISED,):
        assert rule.kind in errors.KINDS, rule


# statuses that only errors.py may spell out; the client side (client.py, wire.py) reads statuses, never maps them
_STATUSES = {v.status for v in errors.KINDS.values()} | set(errors.OPENAI_TYPES)
_CLIENT_SIDE = {"client.py", "wire.py", "errors.py"}


def test_no_other_serving_module_maps_statuses():
    found = []
    for path in sorted(SERVE.rglob("*.py")):
        if path.name in _CLIENT_SIDE:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and type(node.value) is int and node.value in _STATUSES:
                found.append(f"{path.name}:{node.lineno}: {node.value}")
            if isinstance(node, (ast.Attribute, ast.Name)) and getattr(node, "attr", getattr(node, "id", "")) == \
                    "http_status":
                found.append(f"{path.name}:{node.lineno}: http_status")
    assert not found, found
