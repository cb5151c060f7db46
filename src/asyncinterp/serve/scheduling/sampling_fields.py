"""vLLM's extra sampling fields of ``/v1/completions`` and ``/v1/chat/completions``, checked once, then given to
each engine in its own words.

Why this module exists: programs written for vLLM's server send ``top_k``,
``min_p``, ``min_tokens``, ``ignore_eos``, ``repetition_penalty``,
``presence_penalty``, ``frequency_penalty``, ``logit_bias``,
``stop_token_ids``, ``include_stop_str_in_output`` and
``skip_special_tokens`` (vLLM 0.32's request fields, meaning what vLLM's
``SamplingParams`` says). :func:`parse` checks them as vLLM checks them
and keeps only the values that change anything (so a plain request stays
plain and still shares runs with other plain requests).
:func:`vllm_options` and :func:`transformers_options` turn them into
generation keywords for each engine; a field an engine cannot honour is
refused there with a :class:`~.params.BadRequest` that says why, never
ignored. The answer-side fields (``stop_token_ids`` ending the text,
``include_stop_str_in_output``, ``skip_special_tokens``) are applied to the
text by :class:`~.openai_compat.Shaper`, the same way for both engines.
"""

from __future__ import annotations

import math

from .params import BadRequest, short_repr

MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300          # as OpenAI: at most 300 biased tokens
BIAS_LIMIT = 100.0            # vLLM clamps each bias to [-100, 100]

# field -> its neutral value (a request that sends it has asked for nothing)
NEUTRAL = {
    "top_k": 0, "min_p": 0.0, "min_tokens": 0, "ignore_eos": False, "repetition_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": {}, "stop_token_ids": [],
    "include_stop_str_in_output": False, "skip_special_tokens": True,
}
FIELDS = frozenset(NEUTRAL)
SAMPLING_ONLY = ("top_k", "min_p")      # they only narrow what sampling draws from: greedy ignores them
ANSWER_SIDE = ("include_stop_str_in_output", "skip_special_tokens")   # applied to the text by the Shaper


def _bad(message, param):
    exc = BadRequest(message)
    exc.param = param
    return exc


def _number(name, value, lo, hi, lo_open=False):
    if type(value) not in (int, float) or not math.isfinite(value) or not (
            (lo < value if lo_open else lo <= value) and value <= hi):
        raise _bad(f"{name} must be a number in {'(' if lo_open else '['}{lo}, {hi}], got {short_repr(value)}", name)
    return float(value)


def _bool(name, value):
    if type(value) is not bool:
        raise _bad(f"{name} must be true or false, got {short_repr(value)}", name)
    return value


def _token_id(name, value, vocab):
    if type(value) is not int or not 0 <= value < vocab:
        raise _bad(f"{name}: token ids must be ints in [0, {vocab}), got {short_repr(value)}", name)
    return value


def parse(obj: dict, vocab: int, max_tokens: int | None, greedy: bool) -> dict:
    """The vLLM fields of request body ``obj`` that change anything, checked (``BadRequest`` naming the field).

    ``vocab``: how many token ids the model has; ``max_tokens``: the request's limit (``min_tokens`` may not
    pass it); ``greedy``: temperature 0, where ``top_k`` and ``min_p`` change nothing.
    """
    out = {}
    value = obj.get("top_k")
    if value is not None:
        if type(value) is not int or value < -1:
            raise _bad(f"top_k must be 0 or -1 (off) or a positive int, got {short_repr(value)}", "top_k")
        if value > 0:
            out["top_k"] = value
    if obj.get("min_p") is not None:
        out["min_p"] = _number("min_p", obj["min_p"], 0.0, 1.0)
    value = obj.get("min_tokens")
    if value is not None:
        if type(value) is not int or value < 0:
            raise _bad(f"min_tokens must be a non-negative int, got {short_repr(value)}", "min_tokens")
        if max_tokens is not None and value > max_tokens:
            raise _bad(f"min_tokens must be at most max_tokens={max_tokens}, got {value}", "min_tokens")
        out["min_tokens"] = value
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        if obj.get(name) is not None:
            out[name] = _bool(name, obj[name])
    if obj.get("repetition_penalty") is not None:
        out["repetition_penalty"] = _number("repetition_penalty", obj["repetition_penalty"], 0.0, math.inf,
                                            lo_open=True)   # vLLM: any finite number above 0
    for name in ("presence_penalty", "frequency_penalty"):
        if obj.get(name) is not None:
            out[name] = _number(name, obj[name], -2.0, 2.0)
    out.update(_logit_bias(obj.get("logit_bias"), vocab))
    value = obj.get("stop_token_ids")
    if value is not None:
        if not isinstance(value, list) or len(value) > MAX_STOP_TOKEN_IDS:
            raise _bad(f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids", "stop_token_ids")
        out["stop_token_ids"] = list(dict.fromkeys(_token_id("stop_token_ids", t, vocab) for t in value))
    if greedy:
        for name in SAMPLING_ONLY:
            out.pop(name, None)
    return {k: v for k, v in out.items() if v != NEUTRAL[k]}


def _logit_bias(value, vocab) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise _bad(f"logit_bias must be a map of at most {MAX_LOGIT_BIAS} token ids (as strings) to numbers",
                   "logit_bias")
    bias = {}
    for key, b in value.items():
        try:
            tid = int(key)
        except (TypeError, ValueError):
            raise _bad(f"logit_bias: key {short_repr(key)} is not a token id", "logit_bias") from None
        _token_id("logit_bias", tid, vocab)
        if type(b) not in (int, float) or not math.isfinite(b):
            raise _bad(f"logit_bias: the bias of token {tid} must be a finite number", "logit_bias")
        bias[tid] = min(BIAS_LIMIT, max(-BIAS_LIMIT, float(b)))    # vLLM clamps, as OpenAI's range
    return {"logit_bias": bias} if bias else {}


# --------------------------------------------------------------------------- per engine
def vllm_options(fields: dict) -> dict:
    """``SamplingParams`` keywords: vLLM takes every field as it is."""
    return dict(fields)


def transformers_options(fields: dict, eos) -> dict:
    """Keywords of ``LanguageModel.generate`` (transformers' own options and logits processors) for ``fields``;
    ``eos``: the model's end-of-sequence ids (``stop_token_ids`` are added to them)."""
    out = {}
    if fields.get("ignore_eos"):
        out["ignore_eos"] = True       # the generation run and the batcher's watch then end at max_tokens only
    for name in ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        if name in fields:
            out[name] = fields[name]
    if "min_tokens" in fields:
        out["min_new_tokens"] = fields["min_tokens"]
    if "logit_bias" in fields:
        # transformers' SequenceBiasLogitsProcessor; one-token sequences are vLLM's logit_bias
        out["sequence_bias"] = [[[tid], bias] for tid, bias in sorted(fields["logit_bias"].items())]
    if "stop_token_ids" in fields:
        # the row ends at them as at an end-of-sequence token (min_new_tokens holds them back too, as in vLLM)
        ends = fields["stop_token_ids"] if fields.get("ignore_eos") else [*eos, *fields["stop_token_ids"]]
        out["eos_token_id"] = list(dict.fromkeys(ends))
    return out
