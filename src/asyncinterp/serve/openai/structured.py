"""Structured output: OpenAI's ``response_format`` (a JSON schema, or any JSON object), as vLLM's server takes it.

Why this module exists: vLLM's server constrains generation to a JSON schema
(``response_format={"type": "json_schema", "json_schema": {"schema": ...}}``)
or to any JSON object (``{"type": "json_object"}``) with its
structured-output backend (xgrammar), and it does so on this machine's CPU.
On a vLLM engine this server hands the same constraint to vLLM
(``SamplingParams.structured_outputs``, built in
:func:`asyncinterp.models.vllm.requests.sampling_kwargs`), so the answer is
vLLM's. The transformers engine has no grammar backend here: such a request
is refused with a 400 that says so, never answered unconstrained.
"""

from __future__ import annotations

from ..scheduling.params import BadRequest, short_repr


def _bad(message):
    exc = BadRequest(message)
    exc.param = "response_format"
    return exc


def parse(value) -> dict | None:
    """``response_format`` -> vLLM's structured-output keywords (``{"json": schema}`` / ``{"json_object": True}``),
    or ``None`` for plain text."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _bad("response_format must be an object with a 'type': 'text', 'json_object' or 'json_schema'")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise _bad("When response_format type is 'json_schema', the 'json_schema' field must be provided "
                       "with a 'schema' object")
        return {"json": schema}
    raise _bad(f"response_format type {short_repr(kind)} is not supported: use 'text', 'json_object' or "
               "'json_schema'")


def engine_options(constraint, engine: str) -> dict:
    """Generation options for ``constraint`` on ``engine`` (``"vllm"`` or ``"transformers"``)."""
    if constraint is None:
        return {}
    if engine != "vllm":
        raise _bad("response_format (structured output) needs a grammar backend, which this server has only on a "
                   "vLLM engine (asyncinterp serve MODEL --engine vllm); the transformers engine would generate "
                   "unconstrained text, so it refuses the request")
    return {"structured_outputs": constraint}
