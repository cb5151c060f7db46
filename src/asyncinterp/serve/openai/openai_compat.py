"""OpenAI-compatible shapes: ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``.

Why this module exists: programs written for OpenAI's API (the ``openai``
package and everything built on it) should reach an asyncinterp server
unchanged, with an intervention riding along in one extension field of the
request body::

    "asyncinterp": {"intervention": "steer", "params": {...}, "timeout": 5}
    "asyncinterp": {"code": "async def f(m, k): ...", "entry": "f", "params": {"k": 3}}   # --allow-code

This module only translates. A request body becomes a prompt (chat messages
through the tokenizer's chat template), engine-neutral generation keywords
(``do_sample``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``:
both ``LanguageModel.generate`` and ``VLLM.generate`` take them), vLLM's
extra sampling fields (checked by :mod:`.sampling_fields`, handed to each
engine in its words by the server's engine front) and the server's native
intervention spec; a :class:`~.batcher.GenerateResult`, or the
batcher's event stream, becomes OpenAI's JSON answer or its server-sent
events, with the intervention's result (and its ``emit`` values) in an
``asyncinterp`` field. The checks, limits, sandbox, batching, authentication
and error statuses are the server's own (:mod:`.app` calls this module; it
imports nothing from there; the status table, OpenAI's error types included,
is :mod:`.errors`). Invalid requests raise :class:`~.params.BadRequest`
(with ``param``, OpenAI's name of the offending field).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field

import torch

from ...models.generating import stop_hit
from ..jobs.errors import openai_type
from . import logprobs as logprob_fields
from ..scheduling import sampling_fields
from . import structured
from ..scheduling.params import BadRequest, short_repr
from ...client.wire import WireError

EXT = "asyncinterp"   # the extension field, in requests, answers, chunks and errors
MAX_STOPS = 4         # as OpenAI
MAX_STOP_CHARS = 256

# fields OpenAI defines that this server does not implement: accepted only at their neutral values
_NEUTRAL = {
    "echo": (False, None), "top_logprobs": (None, 0), "best_of": (None, 1),
    "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "modalities": (None, ["text"]),
    "audio": (None,), "prediction": (None,),
}
_IGNORED = {"user", "store", "metadata", "service_tier", "parallel_tool_calls"}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n",
           "cache_salt", "response_format", EXT} | sampling_fields.FIELDS   # vLLM's sampling fields
_FIELDS = {
    "completions": _COMMON | {"prompt", "echo", "logprobs"},
    "chat": _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"},
}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_N = 16                                 # choices per prompt
MAX_PROMPTS = 64                           # prompts in one completions request
MAX_CACHE_SALT = 128                       # vLLM's server: at most 128 characters, none of '@', '/', '\\', NUL
_SALT_FORBIDDEN = frozenset("@/\\\x00")


def _bad(message, param=None):
    exc = BadRequest(message)
    exc.param = param
    return exc


# --------------------------------------------------------------------------- requests
@dataclass
class OpenAIRequest:
    """A checked OpenAI request: what to generate and how, and the intervention spec (native form)."""

    kind: str                      # "completions" or "chat"
    model: str
    prompt: object = None          # completions: a string or a list of token ids
    messages: list = None          # chat: [{"role", "content"}] with text content
    max_tokens: int | None = None
    generate: dict = field(default_factory=dict)   # engine-neutral generation keywords
    stop: tuple = ()
    stream: bool = False
    include_usage: bool = False
    intervention: dict | None = None                # the server's native spec, or None
    timeout: float | None = None
    cache_salt: str | None = None                   # vLLM's prefix-cache salt (plain requests only, see docs)
    fields: dict = field(default_factory=dict)      # vLLM's sampling fields that change anything (vLLM's names)
    prompts: list = field(default_factory=list)     # completions: every prompt (a list of prompts: one choice each)
    n: int = 1                                      # choices per prompt
    logprobs: logprob_fields.LogprobRequest = field(default_factory=logprob_fields.LogprobRequest)
    structured: dict | None = None                  # response_format as vLLM's structured-output keywords

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.kind == "chat" else "max_tokens"


def decode_body(body: bytes):
    """The JSON object of a request body (``BadRequest`` otherwise)."""
    if not body:
        raise _bad("empty body: send a JSON object")
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise _bad(f"the body is not valid JSON ({type(exc).__name__})") from None
    if not isinstance(obj, dict):
        raise _bad(f"the body must be a JSON object, got {type(obj).__name__}")
    return obj


def parse_request(kind: str, obj: dict, registered: dict, vocab: int = 1 << 31) -> OpenAIRequest:
    """Check an OpenAI request body (``kind``: ``"completions"`` or ``"chat"``); ``registered``: name -> Registered;
    ``vocab``: how many token ids the model has (token ids in ``logit_bias``/``stop_token_ids`` are checked)."""
    allowed = _FIELDS[kind]
    for key, value in obj.items():
        if key in allowed or key in _IGNORED:
            continue
        if key in _NEUTRAL:
            if not any(value == v and type(value) is type(v) or value is v for v in _NEUTRAL[key]):
                raise _bad(f"{key}={short_repr(value)} is not supported by this server", key)
            continue
        raise _bad(f"unsupported field {short_repr(key)}; this server takes {sorted(allowed | _IGNORED)}",
                   key if isinstance(key, str) else None)
    model = obj.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model is required: the name GET /v1/models lists", "model")
    req = OpenAIRequest(kind, model)
    req.logprobs = logprob_fields.parse(kind, obj)
    req.structured = structured.parse(obj.get("response_format"))
    if kind == "completions":
        req.prompts = _prompts(obj.get("prompt"))
        req.prompt = req.prompts[0]
        req.max_tokens = 1 if req.logprobs.echo_only else _max_tokens(obj, "max_tokens", default=16)
    else:
        req.messages = _messages(obj.get("messages"))
        if obj.get("max_completion_tokens") is not None:
            req.max_tokens = _max_tokens(obj, "max_completion_tokens")
        else:
            req.max_tokens = _max_tokens(obj, "max_tokens")
    n = obj.get("n")
    if n is not None and (type(n) is not int or not 1 <= n <= MAX_N):
        raise _bad(f"n must be an integer in [1, {MAX_N}], got {short_repr(n)}", "n")
    req.n = n or 1
    req.stop = _stops(obj.get("stop"))
    req.generate = _sampling(obj)
    if req.n > 1 and not req.generate.get("do_sample"):
        raise _bad(f"n must be 1 when using greedy sampling, got {req.n}.", "n")   # vLLM's words
    req.fields = sampling_fields.parse(obj, vocab, req.max_tokens, greedy=not req.generate.get("do_sample"))
    if req.stop:
        req.generate["stop"] = list(req.stop)
    stream = obj.get("stream")
    if stream is not None and type(stream) is not bool:
        raise _bad("stream must be true or false", "stream")
    req.stream = bool(stream)
    options = obj.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or any(k != "include_usage" for k in options):
            raise _bad("stream_options takes {'include_usage': bool}", "stream_options")
        if not req.stream:
            raise _bad("stream_options is only allowed with stream=true", "stream_options")
        usage = options.get("include_usage", False)
        if type(usage) is not bool:
            raise _bad("stream_options.include_usage must be true or false", "stream_options")
        req.include_usage = usage
    req.cache_salt = _cache_salt(obj.get("cache_salt"))
    req.intervention, req.timeout = _extension(obj.get(EXT), registered)
    return req


def _cache_salt(value):
    """vLLM's ``cache_salt`` field, checked as vLLM's server checks it."""
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_CACHE_SALT or any(
            c in _SALT_FORBIDDEN for c in value):
        raise _bad(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters without "
                   "'@', '/', '\\' or NUL", "cache_salt")
    return value


def _prompts(value):
    """Completions' ``prompt``: a list of prompts (each a string or token ids)."""
    if isinstance(value, list) and len(value) > 1 and all(isinstance(v, (str, list)) for v in value):
        if len(value) > MAX_PROMPTS:
            raise _bad(f"at most {MAX_PROMPTS} prompts in one request", "prompt")
        return [_prompt(v) for v in value]
    return [_prompt(value)]


def _prompt(value):
    if isinstance(value, str):
        if not value:
            raise _bad("prompt is empty", "prompt")
        return value
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return value
    if isinstance(value, list) and len(value) == 1 and (isinstance(value[0], str) or isinstance(value[0], list)):
        return _prompt(value[0])
    raise _bad("prompt must be a string or a list of token ids", "prompt")


def check_messages(value) -> list:
    """Chat ``messages`` checked and normalised (text content, OpenAI's roles); ``BadRequest`` otherwise."""
    return _messages(value)


def _messages(value):
    if not isinstance(value, list) or not value:
        raise _bad("messages must be a non-empty list of {'role', 'content'}", "messages")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise _bad(f"messages[{i}] must be an object", "messages")
        extra = [k for k in msg if k not in ("role", "content", "name")]
        if extra:
            raise _bad(f"messages[{i}]: unsupported field(s) {[short_repr(k) for k in extra]} (text messages only)",
                       "messages")
        role = _ROLES.get(msg.get("role"))
        if role is None:
            raise _bad(f"messages[{i}].role must be one of {sorted(_ROLES)}, got {short_repr(msg.get('role'))}",
                       "messages")
        out.append({"role": role, "content": _content(msg.get("content"), i)})
    return out


def _content(value, i):
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                           "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


def _max_tokens(obj, name, default=None):
    value = obj.get(name)
    if value is None:
        return default
    if type(value) is not int or value < 1:
        raise _bad(f"{name} must be a positive integer", name)
    return value


def _stops(value):
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop must be a string or a list of strings", "stop")
    stops = [s for s in stops if s]
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise _bad(f"stop takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters", "stop")
    return tuple(stops)


def _number(obj, name, lo, hi, default):
    value = obj.get(name)
    if value is None:
        return default
    if type(value) not in (int, float) or not math.isfinite(value) or not lo <= value <= hi:
        raise _bad(f"{name} must be a number in [{lo}, {hi}]", name)
    return float(value)


def _sampling(obj) -> dict:
    """Generation keywords both engines take: greedy (none) at temperature 0, else sampling with top_k off."""
    temperature = _number(obj, "temperature", 0.0, 2.0, 1.0)   # OpenAI's default is 1: sampling
    top_p = _number(obj, "top_p", 0.0, 1.0, 1.0)
    if top_p == 0.0:
        raise _bad("top_p must be greater than 0", "top_p")
    seed = obj.get("seed")
    if seed is not None and (type(seed) is not int or not -(2 ** 63) <= seed < 2 ** 63):
        raise _bad("seed must be an integer", "seed")
    if temperature == 0.0:
        return {}      # greedy: each engine's default (and the native endpoints'), so these requests share runs
    out = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
    if seed is not None:
        out["seed"] = seed
    return out


def _extension(ext, registered):
    """The ``asyncinterp`` field -> (the server's native intervention spec or None, timeout or None)."""
    if ext is None:
        return None, None
    if not isinstance(ext, dict):
        raise _bad(f"{EXT} must be an object: {{'intervention': name, 'params': {{...}}}} or "
                   "{'code': source, 'entry'?, 'params'}", EXT)
    extra = [k for k in ext if k not in ("intervention", "code", "entry", "params", "timeout")]
    if extra:
        raise _bad(f"{EXT}: unknown field(s) {[short_repr(k) for k in extra]}; it takes intervention or code, "
                   "entry, params, timeout", EXT)
    timeout = ext.get("timeout")
    params = ext.get("params")
    if "intervention" in ext and "code" in ext:
        raise _bad(f"{EXT}: give either 'intervention' (a registered name) or 'code', not both", EXT)
    if "code" in ext:
        spec = {"source": ext["code"], "params": params}
        if ext.get("entry") is not None:
            spec["entry"] = ext["entry"]
        return spec, timeout
    if "entry" in ext:
        raise _bad(f"{EXT}: 'entry' goes with 'code'", EXT)
    name = ext.get("intervention")
    if name is None:
        if params is not None:
            raise _bad(f"{EXT}: 'params' without an 'intervention' or 'code'", EXT)
        return None, timeout
    reg = registered.get(name) if isinstance(name, str) else None
    if reg is not None and isinstance(params, dict):
        params = {k: _tensor_param(reg, k, v) for k, v in params.items()}
    return {"name": name, "params": params}, timeout


def _tensor_param(reg, name, value):
    """A JSON list given for a parameter declared ``torch.Tensor`` becomes ``torch.tensor(value)``."""
    p = reg.params.get(name)
    if p is None or p.type is not torch.Tensor or not isinstance(value, list):
        return value
    try:
        t = torch.tensor(value)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise _bad(f"parameter {name!r}: not a rectangular list of numbers ({exc})", EXT) from None
    if t.dim() > 8 or t.dtype not in (torch.float32, torch.int64, torch.bool):
        raise _bad(f"parameter {name!r}: at most 8 dimensions of numbers", EXT)
    return t


def chat_prompt(tokenizer, messages) -> list:
    """Token ids of ``messages`` rendered by the tokenizer's chat template, ready for the assistant's answer."""
    if not getattr(tokenizer, "chat_template", None):
        raise _bad("this model's tokenizer has no chat template: use POST /v1/completions with a prompt",
                   "messages")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # noqa: BLE001 - a template that rejects these messages (roles, order)
        raise _bad(f"the chat template refused these messages: {type(exc).__name__}: {exc}", "messages") from None
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(t) for t in ids]


# --------------------------------------------------------------------------- results as JSON
def to_json(value, depth: int = 0):
    """A result or emitted value as JSON: tensors -> nested lists, tuples -> lists, non-finite floats ->
    ``"NaN"``/``"Infinity"``/``"-Infinity"``; anything else that JSON cannot hold raises :class:`WireError`."""
    if depth > 64:
        raise WireError("the result nests deeper than 64 levels")
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            raise WireError("a complex tensor cannot be sent as JSON")
        t = value.detach().cpu()
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.float()
        return to_json(t.tolist(), depth + 1)
    if isinstance(value, (list, tuple)):
        return [to_json(v, depth + 1) for v in value]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                raise WireError(f"a result map key of type {type(k).__name__} cannot be sent as JSON")
            out[k if isinstance(k, str) else json.dumps(k)] = to_json(v, depth + 1)
        return out
    raise WireError(f"a result of type {type(value).__name__} cannot be sent as JSON")


def _emitted(items):
    return [{"step": e["step"], "value": to_json(e["value"])} for e in items]


def cut_at_stop(text: str, stops, include: bool = False) -> tuple:
    """``(text before the first stop string, whether one was found)``; ``include``: keep the stop string
    (vLLM's ``include_stop_str_in_output``)."""
    if not stops or not stop_hit(text, stops):
        return text, False
    at, stop = min((text.find(s), s) for s in stops if s in text)
    return text[:at + len(stop)] if include else text[:at], True


# --------------------------------------------------------------------------- answers
class Shaper:
    """OpenAI answers for one request: the JSON response, or its stream of server-sent events.

    ``prompt_tokens``: the prompt's length; ``eos``: end-of-sequence ids
    (a finish reason of ``"stop"``); ``extension``: whether to add the
    ``asyncinterp`` field (the request carried an intervention);
    ``details``: whether usage reports ``prompt_tokens_details.cached_tokens``
    (when the engine counts them: vLLM). ``tokenizer``: decodes the text
    itself when the request's vLLM fields ask for other text than the
    engine's (``stop_token_ids``, ``include_stop_str_in_output``,
    ``skip_special_tokens=false``), as vLLM's detokenizer does: the answer
    ends at the first stop token id (counted, its text left out unless
    ``include_stop_str_in_output``), and with ``ignore_eos`` an
    end-of-sequence token is not an end.
    """

    def __init__(self, req: OpenAIRequest, max_tokens: int, prompt_tokens: int, eos, extension: bool,
                 details: bool = False, tokenizer=None):
        self.req = req
        fields = req.fields
        self.stop_ids = frozenset(fields.get("stop_token_ids", ()))
        self.include_stop = fields.get("include_stop_str_in_output", False)
        self.skip_special = fields.get("skip_special_tokens", True)
        self.decodes = tokenizer is not None and bool(
            self.stop_ids or self.include_stop or not self.skip_special)
        self.tokenizer = tokenizer
        if fields.get("ignore_eos"):
            eos = ()
        self.chat = req.kind == "chat"
        self.object = "chat.completion" if self.chat else "text_completion"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.max_tokens = max_tokens
        self.prompt_tokens = prompt_tokens
        self.eos = frozenset(eos)
        self.extension = extension
        self.details = details
        # streaming state
        self.text = ""           # the generated text so far (all token events)
        self.sent = ""           # what went out (never past a stop string)
        self.tokens = []
        self.stopped = False
        self.replay = None       # after a "restart": how many already-sent tokens to check again
        # one choice of several (n > 1, a list of prompts: see .choices), and logprobs / echo (see .logprobs)
        self.index = 0
        self.prompt_key = 0      # which prompt of the request (usage counts each prompt once)
        self.tail = True         # a stream ends with the usage chunk and [DONE] (a choice of several: not itself)
        self.lp = logprob_fields.Shape(req.logprobs, tokenizer) if req.logprobs.wanted and tokenizer else None
        self.prompt_text = ""    # echo: the prompt's text and ids (set by the server)
        self.prompt_ids = []
        self.lp_pending = []     # streaming: (token id, entry) whose logprobs have not been sent yet
        self.echoed = False
        self.echo_out = ""       # streaming: the echoed prompt, until it goes out
        self.final = None        # streaming: the GenerateResult, once done

    # ---------------------------------------------------------------- one answer
    def finish_reason(self, tokens, hit_stop: bool) -> str:
        if hit_stop or (tokens and tokens[-1] in self.eos) or len(tokens) < self.max_tokens:
            return "stop"
        return "length"

    def answer_tokens(self, tokens) -> tuple:
        """``(tokens through the first stop token id, whether one ended them)``."""
        tokens = list(tokens)
        for i, t in enumerate(tokens):
            if t in self.stop_ids:
                return tokens[:i + 1], True
        return tokens, False

    def answer_text(self, tokens, text) -> tuple:
        """``(tokens, text, whether a stop token id ended them)`` of an answer: the engine's ``text`` unless the
        request's fields ask for text decoded here (see the class)."""
        tokens, hit = self.answer_tokens(tokens)
        if self.decodes:
            ended = hit or (tokens and tokens[-1] in self.eos)
            shown = tokens[:-1] if ended and not self.include_stop else tokens
            text = self.tokenizer.decode(shown, skip_special_tokens=self.skip_special)
        return tokens, text, hit

    def usage(self, g):
        n_tokens = len(self.answer_tokens(g.tokens)[0])
        out = {"prompt_tokens": self.prompt_tokens, "completion_tokens": n_tokens,
               "total_tokens": self.prompt_tokens + n_tokens}
        cached = getattr(g, "cached_tokens", None)
        if self.details and cached is not None:
            out["prompt_tokens_details"] = {"cached_tokens": cached}
        return out

    def ext(self, g):
        return {"result": to_json(g.result), "emitted": _emitted(g.emitted)}

    def choice(self, g) -> dict:
        """This request's choice in the non-streaming answer for a :class:`~.batcher.GenerateResult`."""
        tokens, text, hit_id = self.answer_text(g.tokens, g.text)
        text, hit = cut_at_stop(text, self.req.stop, self.include_stop)
        reason = self.finish_reason(tokens, hit or hit_id)
        logprobs = None
        lpr = self.req.logprobs
        if lpr.echo:     # vLLM: the prompt's text (and ids and logprobs) before the answer's; max_tokens=0: only them
            text = self.prompt_text if lpr.echo_only else self.prompt_text + text
        if self.lp is not None and lpr.top is not None:
            gen = list(zip(tokens, g.logprobs or [None] * len(tokens)))
            pairs = self._prompt_pairs(g) + ([] if lpr.echo_only else gen) if lpr.echo else gen
            logprobs = self.lp.build([t for t, _ in pairs], [e for _, e in pairs])
        if self.chat:
            return {"index": self.index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": reason}
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": reason}

    def _prompt_pairs(self, g) -> list:
        entries = g.prompt_logprobs or [None] * len(self.prompt_ids)
        return list(zip(self.prompt_ids, entries))

    def response(self, g) -> dict:
        """The non-streaming answer for a :class:`~.batcher.GenerateResult`."""
        out = {"id": self.id, "object": self.object, "created": self.created, "model": self.req.model,
               "choices": [self.choice(g)], "usage": self.usage(g)}
        if self.extension:
            out[EXT] = self.ext(g)
        return out

    # ---------------------------------------------------------------- a stream
    def _chunk(self, choices, **extra) -> bytes:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.req.model, "choices": choices}
        body.update(extra)
        return sse(body)

    def _piece(self, text=None, reason=None, role=False) -> dict:
        logprobs = self._pending_logprobs() if not role else None
        if self.chat:
            delta = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return {"index": self.index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}

    def _pending_logprobs(self):
        """Streaming: the logprobs of the tokens not reported yet (vLLM reports a chunk's tokens with it)."""
        if self.lp is None or self.req.logprobs.top is None or not self.lp_pending:
            return None
        pairs, self.lp_pending = self.lp_pending, []
        return self.lp.build([t for t, _ in pairs], [e for _, e in pairs])

    def _echo(self, prompt_entries) -> str:
        """Streaming echo: the prompt's text goes out before the first token's (its logprobs with it)."""
        if self.echoed or not self.req.logprobs.echo:
            return ""
        self.echoed = True
        entries = prompt_entries or [None] * len(self.prompt_ids)
        if self.req.logprobs.top is not None:
            self.lp_pending[:0] = list(zip(self.prompt_ids, entries))
        self.echo_out = self.prompt_text
        return self.prompt_text

    def start(self) -> bytes:
        """The first event: chat streams open with the assistant's role (as OpenAI's do)."""
        if self.req.logprobs.echo_only:
            return b""
        return self._chunk([self._piece("", role=True)]) if self.chat else b""

    def event(self, ev) -> bytes:
        """Server-sent events for one batcher event (``token``, ``emit``, ``restart``, ``done``)."""
        kind = ev.get("event")
        if kind == "token":
            return self._token(ev)
        if kind == "emit":
            return self._chunk([], **{EXT: {"emit": {"step": ev["step"], "value": to_json(ev["value"])}}})
        if kind == "restart":
            # the batch failed and this request runs again alone: its replayed tokens are checked against
            # what was already sent (greedy decoding repeats them) and not sent twice
            self.replay = (list(self.tokens), 0)
            return b""
        if kind == "done":
            return self._done(ev["result"])
        return b""

    def _token(self, ev) -> bytes:
        if self.replay is not None:
            before, i = self.replay
            if i < len(before):
                if before[i] != ev["token"]:
                    raise RuntimeError("this request's shared run failed and its rerun generated other tokens "
                                       "than the ones already streamed; retry the request")
                self.replay = (before, i + 1)
                return b""
            self.replay = None
        self.tokens.append(ev["token"])
        if self.stopped:
            return b""
        if self.req.logprobs.echo_only:
            return b""           # max_tokens=0: the prompt alone, sent when the request is done
        if self.lp is not None:
            self._echo(ev.get("prompt_logprobs"))
            if self.req.logprobs.top is not None:
                self.lp_pending.append((ev["token"], ev.get("logprobs")))
        if not self.decodes:
            self.text += ev["text"]
            return self._send(final=False) + self._echo_alone()
        _, self.text, hit_id = self.answer_text(self.tokens, "")
        out = self._send(final=hit_id)
        self.stopped = self.stopped or hit_id
        return out + self._echo_alone()

    def _echo_alone(self) -> bytes:
        """An echoed prompt still unsent (the first token's text is held back): it goes out now, alone."""
        if not self.echo_out:
            return b""
        piece, self.echo_out = self.echo_out, ""
        return self._chunk([self._piece(piece)])

    def _send(self, final: bool) -> bytes:
        """Send what is safe: never a stop string, nor (until the end) a tail that may begin one."""
        visible, hit = cut_at_stop(self.text, self.req.stop, self.include_stop)
        if hit:
            self.stopped = True
        elif not final:
            hold = 0
            for s in self.req.stop:
                for k in range(min(len(s) - 1, len(visible)), 0, -1):
                    if visible.endswith(s[:k]):
                        hold = max(hold, k)
                        break
            visible = visible[:len(visible) - hold]
        if not visible.startswith(self.sent) or len(visible) == len(self.sent):
            return b""
        piece, self.sent = visible[len(self.sent):], visible
        if self.echo_out:
            piece, self.echo_out = self.echo_out + piece, ""
        return self._chunk([self._piece(piece)])

    def _done(self, g) -> bytes:
        out = []
        self.final = g
        if self.req.logprobs.echo_only:
            return self._done_echo_only(g)
        if not self.tokens and not self.text:
            self.tokens = list(g.tokens)   # no token events came (an engine that does not stream tokens)
        tokens, text, hit_id = self.answer_text(g.tokens, g.text)
        self.text = text if text.startswith(self.text) else self.text
        out.append(self._send(final=True))
        _, hit = cut_at_stop(text, self.req.stop)
        hit = hit or hit_id
        extra = {EXT: self.ext(g)} if self.extension else {}
        out.append(self._chunk([self._piece(None if self.chat else "", reason=self.finish_reason(tokens, hit))],
                               **extra))
        out.append(self._tail(g))
        return b"".join(out)

    def _tail(self, g) -> bytes:
        if not self.tail:
            return b""
        out = b""
        if self.req.include_usage:
            out = self._chunk([], usage=self.usage(g))
        return out + DONE

    def _done_echo_only(self, g) -> bytes:
        """``echo`` with ``max_tokens=0``: one chunk, the prompt with its logprobs (as vLLM's)."""
        tokens, _, hit_id = self.answer_text(g.tokens, g.text)
        if self.lp is not None and self.req.logprobs.top is not None:
            self.lp_pending = self._prompt_pairs(g)
        extra = {EXT: self.ext(g)} if self.extension else {}
        piece = self._piece(self.prompt_text, reason=self.finish_reason(tokens, hit_id))
        return self._chunk([piece], **extra) + self._tail(g)

    def error(self, body: dict) -> bytes:
        """An error in the middle of a stream (the ``openai`` client raises it as an ``APIError``)."""
        return sse(body) + DONE


DONE = b"data: [DONE]\n\n"


def sse(obj) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), allow_nan=False).encode() + b"\n\n"


# --------------------------------------------------------------------------- errors and models
def error_body(status: int, error: dict, param=None, code=None) -> dict:
    """OpenAI's error shape for one of the server's errors (its ``type``, ``message``, ``traceback``,
    ``notes``, ``kind``); the server's details stay in an ``asyncinterp`` field."""
    return {"error": {"message": error.get("message", ""), "type": openai_type(status),
                      "param": param, "code": code or error.get("kind"),
                      EXT: {k: error[k] for k in ("type", "traceback", "notes", "kind") if k in error}}}


def models_list(name: str, created: int) -> dict:
    """The ``GET /v1/models`` answer: the one served model."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                        "owned_by": "asyncinterp"}]}

