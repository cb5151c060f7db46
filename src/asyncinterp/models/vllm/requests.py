"""One vLLM request of a job: its prompt, its sampling parameters, and the carrier of its results.

Each invoke with a prompt is one vLLM request. Its prompt becomes token ids
(:func:`prompt_ids`: a string, ids, a tensor, or a mapping as vLLM's prompts
take, with an optional ``cache_salt``); its sampling parameters are the job's
generation options with the invoke's own keywords on top
(:func:`request_params`, transformers-style keywords translated by
:func:`sampling_kwargs`). Its results arrive in a :class:`VLLMInvoke`: the
tokens, text and logprobs step by step, the interventions' outcomes when the
job is done.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ...invoke import Invoke, RunStopped
from ...kernel.errors import RunCancelled
from ..generating import Generated, GeneratedInvoke

__all__ = ["VLLMInvoke", "prompt_ids", "request_params", "sampling_kwargs"]


class VLLMInvoke(GeneratedInvoke):
    """One vLLM request and its interventions: ``.result``, ``.tokens``, ``.text`` after the run.

    Tokens, text and logprobs arrive step by step (the live loop calls
    :meth:`add_output`); ``outcomes``, what became of each intervention
    (:class:`~.worker.Outcome`, sent back by the model's side), arrive when
    the job is done and are what :meth:`value` reads. The run's kernel lives
    with the model, so ``tasks`` stays empty on this side.
    """

    repr_name = "VLLMInvoke"

    def __init__(self, index, spec):
        Invoke.__init__(self, index, spec)
        self.prompt_ids = None
        self.params = None
        self.request_id = None       # our (external) vLLM request id
        self.lora_request = None     # the request's LoRA adapter (vllm LoRARequest), None: the base model
        self.token_ids = []
        self.text_pieces = []        # vLLM's detokenized text, one piece per engine step
        self.finish_reason = None
        self.logprobs = []           # with logprobs=k: per generated token, {token id: log-probability}
        self.prompt_logprobs = None  # with prompt_logprobs=k: per prompt token, None then {token id: log-prob}
        self.cached_tokens = None    # prompt tokens vLLM took from its prefix cache (0 for intervened requests)
        self.outcomes = ()           # one Outcome per intervention, once the job is done

    def add_output(self, completion, finished: bool) -> None:
        """Record one engine step's output for this request (a vLLM ``CompletionOutput``, delta mode)."""
        self.token_ids.extend(completion.token_ids)
        self.text_pieces.append(completion.text)
        if completion.logprobs:
            self.logprobs.extend({int(t): float(lp.logprob) for t, lp in entry.items()}
                                 for entry in completion.logprobs)
        if finished:
            self.finish_reason = completion.finish_reason

    def logprob_at(self, i):
        """The logprobs entry of generated token ``i`` (``None`` if not there)."""
        return self.logprobs[i] if i < len(self.logprobs) else None

    def add_prompt_logprobs(self, entries) -> None:
        """Record a request's prompt logprobs (vLLM sends them once, when its prompt has been computed)."""
        if entries and self.prompt_logprobs is None:
            self.prompt_logprobs = [None if e is None else {int(t): float(lp.logprob) for t, lp in e.items()}
                                    for e in entries]

    def value(self):
        """The interventions' result from their outcomes (see :meth:`Invoke.value`; ``None`` without any)."""
        if self.cancelled:
            raise RunCancelled(f"invoke {self.index} was cancelled (Invoke.cancel); "
                               "the other invokes of its run went on")
        outcomes = self.outcomes
        for o in outcomes:
            if not o.done or o.closed:
                raise RunStopped(f"intervention {o.name!r} of invoke {self.index} did not finish: "
                                 "the run stopped early")
            if o.exc is not None:
                raise o.exc
        if len(outcomes) == 1:
            return outcomes[0].result
        return tuple([o.result for o in outcomes]) if outcomes else None

    def generated_so_far(self) -> Generated:
        return Generated(torch.tensor(self.token_ids, dtype=torch.long), "".join(self.text_pieces))


def request_params(kind: str, generation: Mapping, options: Mapping):
    """The ``SamplingParams`` of one request: ``options`` (the invoke's) over the job's ``generation`` options.

    A ``"trace"`` job makes one new token per request and takes no job-level options.
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    if "adapter" in options or "adapter" in generation:    # the request's LoRA adapter, not a sampling field
        options = {k: v for k, v in options.items() if k != "adapter"}
        generation = {k: v for k, v in generation.items() if k != "adapter"}
    given = options.get("sampling_params")
    if given is not None:
        params = given.clone()
    else:
        if kind == "trace":
            kw, max_new_tokens = {}, 1
        else:
            kw = dict(generation)
            max_new_tokens = kw.pop("max_new_tokens", None)
        kw.update(options)
        params = SamplingParams(**sampling_kwargs(kw, max_new_tokens))
    if getattr(params, "n", 1) != 1:
        raise ValueError("n > 1 is not supported: one invoke is one request (use several invokes)")
    params.output_kind = RequestOutputKind.DELTA
    return params


def sampling_kwargs(kw: dict, max_new_tokens) -> dict:
    """transformers-style generation keywords -> ``SamplingParams`` keywords (greedy unless asked)."""
    kw = dict(kw)
    n = kw.pop("max_new_tokens", max_new_tokens)
    if "max_tokens" not in kw:
        kw["max_tokens"] = n
    if kw["max_tokens"] is not None and (not isinstance(kw["max_tokens"], int) or kw["max_tokens"] < 1):
        raise ValueError(f"max_new_tokens must be a positive int, got {kw['max_tokens']!r}")
    if isinstance(kw.get("structured_outputs"), Mapping):      # vLLM's keywords, e.g. {"json": schema}
        from vllm.sampling_params import StructuredOutputsParams
        kw["structured_outputs"] = StructuredOutputsParams(**kw["structured_outputs"])
    do_sample = kw.pop("do_sample", None)
    if do_sample is False:
        kw["temperature"] = 0.0
    elif do_sample is True:
        kw.setdefault("temperature", 1.0)
    else:
        kw.setdefault("temperature", 0.0)
    return kw


def prompt_ids(input, tokenizer) -> list:
    """One request's prompt as token ids: a string, token ids (list / 1-D tensor), or a mapping."""
    if isinstance(input, str):
        if not input:
            raise ValueError("empty prompt: a causal language model needs at least one token to predict from")
        ids = list(tokenizer(input)["input_ids"])
    elif isinstance(input, Mapping):
        key = "prompt_token_ids" if "prompt_token_ids" in input else "input_ids"
        if key not in input:
            raise ValueError(f"a mapping input needs 'prompt_token_ids' or 'input_ids', got keys {sorted(input)}")
        salt = input.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
        scope = input.get("cache_scope")
        if scope is not None and (not isinstance(scope, str) or not scope):
            raise ValueError(f"cache_scope must be a non-empty string, got {scope!r}")
        ids = input[key]
        if isinstance(ids, torch.Tensor):
            if ids.dim() == 2 and ids.shape[0] == 1:
                ids = ids[0]
            ids = ids.tolist()
        elif ids and isinstance(ids[0], (list, tuple)):
            if len(ids) != 1:
                raise ValueError("one vLLM invoke is one request: give one prompt (use one invoke per prompt)")
            ids = ids[0]
        ids = list(ids)
    elif isinstance(input, torch.Tensor):
        if input.dim() == 2 and input.shape[0] == 1:
            input = input[0]
        if input.dim() != 1 or input.dtype.is_floating_point:
            raise ValueError(f"token ids must be a 1-D integer tensor (one request), got shape {tuple(input.shape)}")
        ids = input.tolist()
    elif isinstance(input, (list, tuple)):
        if input and all(isinstance(x, str) for x in input):
            raise ValueError("one vLLM invoke is one request: give one prompt per invoke "
                             "(`for p in prompts: tr.invoke(p, fn)`)")
        if input and isinstance(input[0], (list, tuple)):
            if len(input) != 1:
                raise ValueError("one vLLM invoke is one request: give one prompt per invoke")
            input = input[0]
        ids = list(input)
    else:
        raise TypeError(f"cannot use {type(input).__name__} as a vLLM prompt: give a string, token ids "
                        "(list of ints or 1-D tensor) or a dict with 'prompt_token_ids'")
    if not ids:
        raise ValueError("empty prompt: a causal language model needs at least one token to predict from")
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool):
            raise TypeError(f"token ids must be ints, got {t!r}")
    return ids
