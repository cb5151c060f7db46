"""LoRA adapters (``peft``) on a ``LanguageModel``: the active adapter chosen per run, its layers as hook points.

    model = ai.LanguageModel(peft_model, tokenizer)      # a peft.PeftModel: adapters already attached
    model.trace(prompt, fn, adapter="b")                 # this run uses adapter "b"
    with model.generate(max_new_tokens=5, adapter="a") as tr: ...

The envoy tree is the transformers model with peft's layers in place, so
paths are those of the plain model plus the LoRA parts:
``m.model.layers[0].self_attn.q_proj.lora_A["a"].output``. ``adapter=``
switches the active adapter (``peft_model.set_adapter``) for one run only:
the previous adapter and every ``requires_grad`` flag peft changed are
restored when the run ends, even when it fails. Without ``adapter=`` a run
uses whatever adapter is active.
"""

from __future__ import annotations

import contextlib
import contextvars

from ...model import _NOTHING as _model_nothing
from ..generating import _NOTHING as _generating_nothing
from .language import LanguageModel

__all__ = ["PeftLanguageModel", "is_peft_model", "tiny_lora_llama"]

_NOTHING = _model_nothing        # the sentinels of the methods wrapped here (no input given)
_NO_PROMPT = _generating_nothing
_ADAPTER = contextvars.ContextVar("asyncinterp_lora_adapter", default=None)   # the adapter of the run being made


def is_peft_model(model) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (checked without importing peft when it is not loaded)."""
    import sys
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


class PeftLanguageModel(LanguageModel):
    """A :class:`LanguageModel` over a ``peft.PeftModel`` (``ai.LanguageModel(peft_model, tok)`` makes one)."""

    def __init__(self, peft_model, tokenizer=None, envoys: dict | None = None):
        LanguageModel.__init__(self, peft_model.get_base_model(), tokenizer, envoys=envoys)
        object.__setattr__(self, "peft_model", peft_model)

    @property
    def adapters(self) -> list:
        """The names of the attached adapters."""
        return list(self.peft_model.peft_config)

    @property
    def active_adapter(self):
        """The adapter runs use when they name none."""
        return self.peft_model.active_adapter

    # ------------------------------------------------------------------ choosing the adapter of a run
    def engine(self, kind: str = "trace"):
        engine = LanguageModel.engine(self, kind)
        adapter = _ADAPTER.get()
        return engine if adapter is None else AdapterEngine(engine, adapter)

    @contextlib.contextmanager
    def _adapter(self, adapter):
        if adapter is None:
            yield
            return
        if adapter not in self.peft_model.peft_config:
            raise ValueError(f"no adapter {adapter!r} on this model; attached: {self.adapters} "
                             "(add one with peft_model.add_adapter / load_adapter)")
        token = _ADAPTER.set(adapter)
        try:
            yield
        finally:
            _ADAPTER.reset(token)

    def trace(self, input=_NOTHING, *fns, adapter: str | None = None, **kwargs):
        """``LanguageModel.trace``; ``adapter=``: the LoRA adapter active during this run only."""
        with self._adapter(adapter):   # the run's engine is chosen while the run is made
            return LanguageModel.trace(self, input, *fns, **kwargs)

    async def atrace(self, input=_NOTHING, *fns, adapter: str | None = None, **kwargs):
        with self._adapter(adapter):   # a context variable: other tasks do not see it
            return await LanguageModel.atrace(self, input, *fns, **kwargs)

    def generate(self, input=_NO_PROMPT, *fns, adapter: str | None = None, **options):
        """``LanguageModel.generate``; ``adapter=``: the LoRA adapter active during this generation only."""
        with self._adapter(adapter):
            return LanguageModel.generate(self, input, *fns, **options)

    async def agenerate(self, input=_NO_PROMPT, *fns, adapter: str | None = None, **options):
        with self._adapter(adapter):
            return await LanguageModel.agenerate(self, input, *fns, **options)


LanguageModel._variants.append((is_peft_model, PeftLanguageModel))


class AdapterEngine:
    """Another engine's runs with adapter ``adapter`` active (switched back when each run ends)."""

    def __init__(self, engine, adapter):
        self.inner = engine
        self.model = engine.model
        self.adapter = adapter

    def make_invoke(self, index, input, fns, kwargs, deferred):
        return self.inner.make_invoke(index, input, fns, kwargs, deferred)

    def start(self, job):
        return AdapterExecution(self.inner.start(job), self.model.peft_model, self.adapter)


class AdapterExecution:
    """An execution whose ``wait`` runs with a LoRA adapter active; everything else is the inner run's."""

    def __init__(self, execution, peft_model, adapter):
        object.__setattr__(self, "execution", execution)
        object.__setattr__(self, "peft_model", peft_model)
        object.__setattr__(self, "adapter", adapter)

    def wait(self, *args, **kwargs):
        with active_adapter(self.peft_model, self.adapter):
            return self.execution.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.execution, name)

    def __setattr__(self, name, value):
        setattr(self.execution, name, value)


@contextlib.contextmanager
def active_adapter(peft_model, adapter):
    """In the block ``adapter`` is active; after it, the previous adapter and ``requires_grad`` flags are back."""
    previous = peft_model.active_adapter
    if previous == adapter:
        yield
        return
    flags = [(p, p.requires_grad) for p in peft_model.parameters()]
    peft_model.set_adapter(adapter)
    try:
        yield
    finally:
        peft_model.set_adapter(previous)
        for p, flag in flags:
            if p.requires_grad != flag:
                p.requires_grad_(flag)


def tiny_lora_llama(adapters=("red", "blue"), seed: int = 0, rank: int = 4):
    """A tiny random Llama (``bundled.tiny_llama``) with random LoRA adapters on q/v projections: ``(peft_model, tok)``.

    The adapters' weights are random (``init_lora_weights=False``), so each
    changes the outputs; the first one is active. For tests and docs.
    """
    import torch
    from peft import LoraConfig, get_peft_model

    from .bundled import tiny_llama
    base, tok = tiny_llama(seed=seed)
    peft_model = None
    for i, name in enumerate(adapters):
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                            init_lora_weights=False)
        with torch.random.fork_rng():
            torch.manual_seed(seed + 1 + i)
            if peft_model is None:
                peft_model = get_peft_model(base, config, adapter_name=name)
            else:
                peft_model.add_adapter(name, config)
    peft_model.set_adapter(adapters[0])
    return peft_model.eval(), tok
