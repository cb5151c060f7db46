"""What the server does differently for each kind of engine, decided once when the server starts.

Why this module exists: the endpoints must not ask "is this a vLLM engine?"
each time they need to know a context length, the end-of-sequence ids,
how a prompt goes to the engine, or whether a forked worker can serve the
model. :func:`front_for` looks at the model once and returns the front of
its kind; :class:`~.app.Server` keeps it as ``server.front`` and the
endpoints, the CLI and the supervisor ask it.

* :class:`EngineFront` — a model run in this process by its own forward
  (``ai.LanguageModel`` of transformers, or any module wrapped with ``ai.wrap``);
* :class:`VLLMFront` — ``ai.VLLM`` (an in-process vLLM engine): a live
  engine with a prefix cache (salted per request), which cannot be forked.

The batching itself is the :class:`~.batcher.Batcher`'s (it hands a live
engine each request at once); the front only shapes what it is given.
"""

from __future__ import annotations

import torch

from ...models.generating import eos_ids
from . import sampling_fields
from .batcher import is_live_engine


class EngineFront:
    """A model run by its own forward in this process: ``ai.LanguageModel`` or a wrapped module.

    ``generates``: whether it is a language model (a tokenizer, ``generate``).
    """

    kind = "transformers"

    def __init__(self, model):
        self.model = model
        self.generates = hasattr(model, "tokenizer") and hasattr(model, "generate")
        self._vocab = None

    @property
    def context_length(self) -> int | None:
        """The model's context (prompt + new tokens), if it has one (transformers: from its config)."""
        return getattr(self.model, "context_length", None)

    def vocab_size(self) -> int:
        """How many token ids the model's embedding takes (input ids are checked against it)."""
        if self._vocab is None:
            self._vocab = self._count_vocab()
        return self._vocab

    def _count_vocab(self) -> int:
        emb = None
        if hasattr(self.model.module, "get_input_embeddings"):
            try:
                emb = self.model.module.get_input_embeddings()
            except TypeError:      # a module whose method takes input ids (as vLLM's do)
                emb = None
        if isinstance(emb, torch.nn.Embedding):
            return int(emb.num_embeddings)
        return self._configured_vocab()

    def _configured_vocab(self) -> int:
        config = getattr(self.model.module, "config", None)
        if getattr(config, "vocab_size", None):
            return int(config.vocab_size)
        return len(self.model.tokenizer)

    def eos_ids(self) -> tuple:
        """End-of-sequence token ids (a generation that ends on one finished by itself)."""
        return eos_ids(self.model, getattr(self.model, "tokenizer", None))

    def generation_input(self, prompt, cache_salt=None, cache_scope=None):
        """What the batcher is handed for ``prompt`` (a string or token ids); ``cache_salt``: vLLM's prefix-cache
        salt, ``cache_scope``: the prefix-cache scope of a named edit set (:mod:`.model_names`), which other
        engines have no use for (they share no cache between requests)."""
        return prompt

    def fork_refusal(self) -> str | None:
        """Why a worker process forked from the server could not serve this model (``None``: it can)."""
        return None

    def sampling_options(self, fields: dict) -> dict:
        """Generation keywords for a request's vLLM sampling fields (:mod:`.sampling_fields`); ``BadRequest``
        for one this engine cannot honour. transformers: its own options and logits processors."""
        return sampling_fields.transformers_options(fields, self.eos_ids())


class VLLMFront(EngineFront):
    """``ai.VLLM``: a live engine that takes requests while it runs and keeps a prefix cache."""

    kind = "vllm"

    @property
    def context_length(self) -> int | None:
        return getattr(self.model, "max_model_len", None)

    def _count_vocab(self) -> int:
        # its model's get_input_embeddings embeds ids; under tensor parallelism the driver holds only a skeleton
        # without a config, and the tokenizer's length is what is left
        return self._configured_vocab()

    def generation_input(self, prompt, cache_salt=None, cache_scope=None):
        # the engine's run salts a plain request's prefix cache with it; a request with an intervention gets a
        # salt of its own instead, unless it runs only a named edit set: then its scope's (LiveJob.cache_salt)
        if cache_salt is None and cache_scope is None:
            return prompt
        ids = prompt if isinstance(prompt, list) else list(self.model.tokenizer(prompt)["input_ids"])
        out = {"prompt_token_ids": ids}
        if cache_salt is not None:
            out["cache_salt"] = cache_salt
        if cache_scope is not None:
            out["cache_scope"] = cache_scope
        return out

    def sampling_options(self, fields: dict) -> dict:
        # vLLM's own SamplingParams fields, per request
        return sampling_fields.vllm_options(fields)

    def fork_refusal(self) -> str | None:
        return ("process isolation does not support vLLM engines (they own threads and processes that a fork "
                "does not copy); use isolation='thread'")


def front_for(model) -> EngineFront:
    """The front of ``model``'s engine kind."""
    return VLLMFront(model) if is_live_engine(model) else EngineFront(model)
