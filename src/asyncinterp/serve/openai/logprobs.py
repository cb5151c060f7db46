"""``logprobs``, ``top_logprobs`` and ``echo`` of the OpenAI endpoints, with vLLM 0.32's meaning and answer shapes.

Why this module exists: evaluation harnesses score a model through these
fields (``echo=true, logprobs=k, max_tokens=0``: the log-likelihood of a
text), and under an intervention they are the way to ask how a change to the
model changes a score. :func:`parse` checks the fields as vLLM's server does;
:func:`engine_options` turns them into the generation options both engines
take (``logprobs=k`` and ``prompt_logprobs=k``: vLLM's ``SamplingParams``
on ``ai.VLLM``, :mod:`asyncinterp.models.hf.logprobs` on transformers, both
the *raw* log-probabilities of the model as it ran, interventions included);
:class:`Shape` writes the answers' ``logprobs`` objects exactly as vLLM's
server does (completions: ``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``; chat: ``content`` with ``token``, ``logprob``, ``bytes``,
``top_logprobs``), from entries in vLLM's order (the position's own token
first, then the ``k`` most likely).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..scheduling.params import BadRequest, short_repr

MAX_LOGPROBS = 20      # vLLM's server default (--max-logprobs 20)
FLOOR = -9999.0        # vLLM writes -inf as this (JSON has no infinity)


def _bad(message, param):
    exc = BadRequest(message)
    exc.param = param
    return exc


@dataclass
class LogprobRequest:
    """What a request asked: ``top`` per generated token (``None``: no logprobs), ``echo`` the prompt (completions),
    ``echo_only``: ``max_tokens=0`` (the prompt's log-likelihood alone), ``chat``: chat's answer shape."""

    top: int | None = None
    echo: bool = False
    echo_only: bool = False
    chat: bool = False

    @property
    def wanted(self) -> bool:
        return self.top is not None or self.echo


def _count(name, value):
    if type(value) is not int:
        raise _bad(f"{name} must be an integer, got {short_repr(value)}", name)
    if value == -1 or value > MAX_LOGPROBS:
        raise _bad(f"{name}={value}: this server reports at most {MAX_LOGPROBS} top log-probabilities per token "
                   f"(as vLLM's server by default)", name)
    if value < 0:
        raise _bad(f"{name} must be a positive value or -1, got {value}", name)
    return value


def parse(kind: str, obj: dict) -> LogprobRequest:
    """The request's logprob fields, checked as vLLM checks them (``BadRequest`` naming the field)."""
    out = LogprobRequest(chat=kind == "chat")
    if kind == "completions":
        if obj.get("logprobs") is not None:
            out.top = _count("logprobs", obj["logprobs"])
        echo = obj.get("echo")
        if echo is not None and type(echo) is not bool:
            raise _bad(f"echo must be true or false, got {short_repr(echo)}", "echo")
        out.echo = bool(echo)
        if obj.get("max_tokens") == 0:
            if not out.echo:
                raise _bad("max_tokens=0 needs echo=true (the prompt's log-probabilities alone)", "max_tokens")
            out.echo_only = True
        return out
    logprobs = obj.get("logprobs")
    if logprobs is not None and type(logprobs) is not bool:
        raise _bad(f"logprobs must be true or false, got {short_repr(logprobs)}", "logprobs")
    top = obj.get("top_logprobs")
    if top is not None:
        top = _count("top_logprobs", top)
        if top > 0 and not logprobs:
            raise _bad("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    if logprobs:
        out.top = top or 0
    return out


def engine_options(lp: LogprobRequest) -> dict:
    """Generation options for both engines: ``logprobs`` and ``prompt_logprobs`` (counts of top tokens)."""
    out = {}
    if lp.top is not None:
        out["logprobs"] = lp.top
    if lp.echo and lp.top is not None:
        out["prompt_logprobs"] = lp.top      # as vLLM's server: echo with logprobs asks for the prompt's
    return out


class Shape:
    """Writes the ``logprobs`` object of one choice (or one streamed chunk) in vLLM's shape."""

    def __init__(self, lp: LogprobRequest, tokenizer):
        self.lp = lp
        self.tokenizer = tokenizer
        self._decoded = {}
        self.offset = 0          # completions: where the next token's text_offset starts (streaming)

    def token(self, tid: int) -> str:
        s = self._decoded.get(tid)
        if s is None:
            s = self._decoded[tid] = self.tokenizer.decode([tid])
        return s

    def build(self, token_ids, entries):
        """The ``logprobs`` value for these tokens and their entries (``None`` when logprobs were not asked)."""
        if self.lp.top is None:
            return None
        if self.lp.chat:
            return {"content": [self._chat(t, e) for t, e in zip(token_ids, entries)]}
        return self._completion(token_ids, entries)

    def _completion(self, token_ids, entries):
        k = self.lp.top
        offsets, lps, tokens, tops = [], [], [], []
        last = 0
        for i, (tid, entry) in enumerate(zip(token_ids, entries)):
            token = self.token(tid)
            if entry is None or tid not in entry:
                lps.append(None)
                tops.append(None)
            else:
                lps.append(max(entry[tid], FLOOR))
                top = {}
                for j, (t, v) in enumerate(entry.items()):
                    if j <= k:         # the position's token and the k most likely (vLLM: "k + 1" at most)
                        top.setdefault(self.token(t), max(v, FLOOR))
                tops.append(top)
            tokens.append(token)
            offsets.append(self.offset if i == 0 else offsets[-1] + last)
            last = len(token)
        if tokens:
            self.offset = offsets[-1] + last
        return {"text_offset": offsets, "token_logprobs": lps, "tokens": tokens, "top_logprobs": tops}

    def _chat(self, tid, entry):
        token = self.token(tid)
        if entry is None or tid not in entry:
            return {"token": token, "logprob": FLOOR, "bytes": list(token.encode("utf-8", errors="replace")),
                    "top_logprobs": []}
        top = []
        for j, (t, v) in enumerate(entry.items()):
            if j < self.lp.top:
                s = self.token(t)
                top.append({"token": s, "logprob": max(v, FLOOR), "bytes": list(s.encode("utf-8", errors="replace"))})
        return {"token": token, "logprob": max(entry[tid], FLOOR),
                "bytes": list(token.encode("utf-8", errors="replace")), "top_logprobs": top}

