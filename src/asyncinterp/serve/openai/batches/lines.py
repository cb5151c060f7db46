"""The lines of a batch: OpenAI's request-line format in, its answer-line format out.

Why this module exists: a batch input file holds one request per line,
as OpenAI defines it::

    {"custom_id": "q-17", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

and the output and error files hold one answer per line::

    {"id": "batch_req_...", "custom_id": "q-17",
     "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}

This module checks the input (every line's shape; a batch whose file has a
bad line fails validation with OpenAI's ``errors`` list, naming each line)
and writes the answer lines. What a body asks for is not checked here: the
server answers each body exactly as ``POST url`` would (:mod:`.runner`),
errors included, so a body the synchronous endpoint refuses becomes that
refusal in the error file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .files import new_id

__all__ = ["ENDPOINTS", "Line", "answer_line", "parse_lines", "skipped_line"]

ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
MAX_ERRORS = 100        # validation errors reported for one file
MAX_CUSTOM_ID = 512


@dataclass(frozen=True)
class Line:
    """One request of a batch: its position in the file, ``custom_id``, endpoint kind and JSON body (bytes)."""

    index: int
    custom_id: str
    kind: str
    body: bytes


def _error(code, message, line, param=None) -> dict:
    return {"code": code, "message": message, "param": param, "line": line}


def parse_lines(data: bytes, endpoint: str) -> tuple:
    """``(lines, errors)`` of a batch input file for ``endpoint``: the requests in file order, or OpenAI's
    validation errors (``[{"code", "message", "param", "line"}]``, at most :data:`MAX_ERRORS`)."""
    lines, errors, seen = [], [], set()
    for number, raw in enumerate(data.decode("utf-8").splitlines(), 1):
        if not raw.strip():
            continue
        if len(errors) >= MAX_ERRORS:
            break
        try:
            obj = json.loads(raw)
        except ValueError:
            errors.append(_error("invalid_json_line", "this line is not valid JSON", number))
            continue
        if not isinstance(obj, dict):
            errors.append(_error("invalid_json_line", "this line is not a JSON object", number))
            continue
        extra = sorted(set(obj) - {"custom_id", "method", "url", "body"})
        custom_id, method, url, body = (obj.get(k) for k in ("custom_id", "method", "url", "body"))
        if extra:
            errors.append(_error("invalid_request", f"unknown field(s) {extra}: a line has custom_id, method, url, "
                                                    "body", number, extra[0]))
        elif not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
            errors.append(_error("missing_required_parameter", "custom_id must be a non-empty string of at most "
                                                               f"{MAX_CUSTOM_ID} characters", number, "custom_id"))
        elif custom_id in seen:
            errors.append(_error("duplicate_custom_id", f"the custom_id {custom_id!r} is used by an earlier line; "
                                                        "each line needs its own", number, "custom_id"))
        elif method != "POST":
            errors.append(_error("invalid_method", f"method must be 'POST', got {str(method)[:20]!r}", number,
                                 "method"))
        elif url != endpoint:
            errors.append(_error("mismatched_endpoint", f"url {str(url)[:80]!r} is not the batch's endpoint "
                                                        f"{endpoint!r}: every line of a batch goes to its endpoint",
                                 number, "url"))
        elif not isinstance(body, dict):
            errors.append(_error("missing_required_parameter", "body must be a JSON object (the request)", number,
                                 "body"))
        else:
            seen.add(custom_id)
            lines.append(Line(len(lines), custom_id, ENDPOINTS[endpoint], json.dumps(body).encode()))
    return lines, errors


def answer_line(line: Line, status: int, body: dict, request_id: str) -> dict:
    """The output (or error) file line of ``line`` answered with ``status`` and ``body``."""
    return {"id": new_id("batch_req_"), "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}


def skipped_line(line: Line, code: str, message: str) -> dict:
    """The error file line of a request that never ran (``batch_expired``, ``batch_cancelled``)."""
    return {"id": new_id("batch_req_"), "custom_id": line.custom_id, "response": None,
            "error": {"code": code, "message": message}}
