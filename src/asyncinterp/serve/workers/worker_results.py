"""What a generation's result carries across the worker-process boundary besides its value, tokens and text.

Why this module exists: with process isolation (:mod:`.supervisor`) a
generation runs in a worker process and comes back as one msgpack map
(:mod:`.worker_proc`'s ``done`` message, no pickle). The OpenAI endpoints'
``logprobs``/``echo`` fields (:mod:`.logprobs`) and the prefix-cache count
read three more fields of :class:`~.requests.GenerateResult` than the
native endpoints do: ``cached_tokens``, ``logprobs`` (per generated token, a
``{token id: log-prob}`` map in vLLM's order: the token first, then the
most likely) and ``prompt_logprobs`` (per prompt token, ``None`` first).
:func:`generation_fields` writes them in the worker; :func:`generation_extras`
reads them back in the server, which trusts nothing a worker sends (the
code worker runs tenants' code): a malformed field raises ``ValueError``
and the server treats the worker as broken, as for any malformed message.
msgpack keeps a map's order and its integer keys, so the entries arrive
exactly as the worker's engine produced them.
"""

from __future__ import annotations

__all__ = ["generation_extras", "generation_fields"]


def generation_fields(g) -> dict:
    """The fields of the :class:`~.requests.GenerateResult` ``g`` that the native answer does not carry (only
    those that are set)."""
    out = {}
    for name in ("cached_tokens", "logprobs", "prompt_logprobs"):
        value = getattr(g, name, None)
        if value is not None:
            out[name] = value
    return out


def generation_extras(value: dict) -> tuple:
    """``(cached_tokens, logprobs, prompt_logprobs)`` from a worker's generation answer ``value`` (each ``None``
    when absent); ``ValueError`` when one is malformed."""
    cached = value.get("cached_tokens")
    if cached is not None and (type(cached) is not int or cached < 0):
        raise ValueError(f"cached_tokens must be a count, got {type(cached).__name__}")
    return cached, _entries(value.get("logprobs"), "logprobs"), _entries(value.get("prompt_logprobs"),
                                                                        "prompt_logprobs")


def _entries(value, name):
    """A list of per-position entries: ``None`` or ``{int token id: float log-prob}``."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a list, got {type(value).__name__}")
    for entry in value:
        if entry is None:
            continue
        if not isinstance(entry, dict) or not all(
                type(k) is int and type(v) in (float, int) for k, v in entry.items()):
            raise ValueError(f"{name}: each entry must be None or a map of token ids to log-probabilities")
    return value
