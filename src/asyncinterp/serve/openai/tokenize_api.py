"""vLLM's ``POST /tokenize``, ``POST /detokenize`` and ``GET /version``: their request and answer shapes.

Why this module exists: programs written for vLLM's server count and cut
prompts with ``/tokenize``/``/detokenize`` and check ``/version``; a drop-in
must answer them with vLLM's field names (vLLM 0.32:
``vllm/entrypoints/serve/tokenize/protocol.py``). This module only
translates between those JSON bodies and the served model's tokenizer (and
its chat template); :mod:`.app` adds authentication, logging and errors.
Invalid bodies raise :class:`~.params.BadRequest` naming the field.
"""

from __future__ import annotations

from ..scheduling.params import BadRequest, short_repr

_COMPLETION = {"model", "prompt", "add_special_tokens", "return_token_strs"}
_CHAT = {"model", "messages", "add_generation_prompt", "return_token_strs", "continue_final_message",
         "add_special_tokens", "chat_template_kwargs"}
_DETOKENIZE = {"model", "tokens"}


def _bad(message, param=None):
    exc = BadRequest(message)
    exc.param = param
    return exc


def _flag(obj, name, default):
    value = obj.get(name)
    if value is None:
        return default
    if type(value) is not bool:
        raise _bad(f"{name} must be true or false", name)
    return value


def _check_fields(obj, allowed):
    extra = [k for k in obj if k not in allowed]
    if extra:
        raise _bad(f"unsupported field(s) {[short_repr(k) for k in extra]}; this endpoint takes {sorted(allowed)}",
                   extra[0] if isinstance(extra[0], str) else None)


def check_model(obj, served: str):
    """vLLM's rule: ``model`` may be left out; given, it must be the served model (``LookupError`` otherwise)."""
    model = obj.get("model")
    if model is not None and model != served:
        raise LookupError(f"the model {short_repr(model)} does not exist here; this server serves {served!r}")


def tokenize(obj: dict, tokenizer, max_model_len: int, messages_of) -> dict:
    """The answer to ``POST /tokenize`` for body ``obj``: a ``prompt`` (completions form) or ``messages``
    (chat form, rendered by the chat template); ``messages_of(value)`` checks chat messages."""
    if "messages" in obj:
        _check_fields(obj, _CHAT)
        if not getattr(tokenizer, "chat_template", None):
            raise _bad("this model's tokenizer has no chat template: tokenize a prompt instead", "messages")
        generation = _flag(obj, "add_generation_prompt", True)
        cont = _flag(obj, "continue_final_message", False)
        if generation and cont:
            raise _bad("cannot set both continue_final_message and add_generation_prompt to true",
                       "continue_final_message")
        kwargs = obj.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise _bad("chat_template_kwargs must be an object", "chat_template_kwargs")
        try:
            text = tokenizer.apply_chat_template(messages_of(obj["messages"]), tokenize=False,
                                                 add_generation_prompt=generation, continue_final_message=cont,
                                                 **kwargs)
        except BadRequest:
            raise
        except Exception as exc:  # noqa: BLE001 - a template that rejects these messages
            raise _bad(f"the chat template refused these messages: {type(exc).__name__}: {exc}",
                       "messages") from None
        ids = tokenizer(text, add_special_tokens=_flag(obj, "add_special_tokens", False))["input_ids"]
    else:
        _check_fields(obj, _COMPLETION)
        prompt = obj.get("prompt")
        if not isinstance(prompt, str):
            raise _bad("prompt must be a string (or send messages, the chat form)", "prompt")
        ids = tokenizer(prompt, add_special_tokens=_flag(obj, "add_special_tokens", True))["input_ids"]
    ids = [int(t) for t in ids]
    strs = tokenizer.convert_ids_to_tokens(ids) if _flag(obj, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(obj: dict, tokenizer, vocab: int) -> dict:
    """The answer to ``POST /detokenize``: ``{"prompt": text}`` of ``obj["tokens"]`` (special tokens kept, as
    vLLM's server does)."""
    _check_fields(obj, _DETOKENIZE)
    tokens = obj.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab for t in tokens):
        raise _bad(f"tokens must be a list of token ids in [0, {vocab})", "tokens")
    return {"prompt": tokenizer.decode(tokens)}


def version(engine: str) -> dict:
    """The answer to ``GET /version``: vLLM's ``version`` field (vLLM's own version when it is the engine, so
    clients that check it see the engine they run on), and this server's."""
    from ... import __version__ as ours
    out = {"version": ours, "asyncinterp": ours, "engine": engine}
    if engine == "vllm":
        try:
            import vllm
            out["version"] = vllm.__version__
        except Exception:  # noqa: BLE001 - the engine runs, so this only fails in odd set-ups
            pass
    return out
