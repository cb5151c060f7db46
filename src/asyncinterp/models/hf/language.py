"""``LanguageModel``: a Hugging Face causal LM with a tokenizer, batching and generation.

    import asyncinterp as ai
    model = ai.LanguageModel.from_pretrained(path)          # or ai.LanguageModel(hf_model, tokenizer)

    async def last_hidden(m):
        return (await m.model.layers[3].output)[:, -1]

    h = model.trace("The Eiffel Tower is in", last_hidden)
    gen = model.generate("Once upon a time", steer, max_new_tokens=30)
    print(gen.text, gen.result)

The root envoy mirrors the transformers model (``m.model.layers[3]``,
``m.transformer.h[3]``, ``m.lm_head``). Prompts of several invokes are
left-padded into one batch with attention masks and position ids, and each
invoke sees only its rows and its real tokens (see :mod:`.padding`), so its
results equal those of a run on its prompt alone. During generation the
extra hook points ``m.logits`` (next-token scores, editable) and
``m.tokens`` (the chosen ids) fire once per step, and ``m.generated`` gives
what has been generated so far.
"""

from __future__ import annotations

import inspect

from ...kernel.errors import NotInRunError
from ...kernel.scheduler import current_run, current_task
from ...model import Model
from ..generating import GeneratingModel, generation_point
from .inputs import context_length
from .runs import GenerateRun, Generation, LMForwardEngine, LMGenerateEngine, LMRun  # noqa: F401 (public names)
from .taps import make_taps



class _logits_point(generation_point):
    """``m.logits``: in a generation the scores tap; in a trace the last position of ``lm_head``'s output."""

    def __get__(self, envoy, owner=None):
        if envoy is None:
            return self
        host = current_run()
        if host is not None and not getattr(host, "generating", True) and host.model is envoy:
            made = envoy.points.get("logits")
            if made is None:
                made = envoy.build_semantic_point(envoy, "logits")
                envoy.points["logits"] = made
            return made
        return envoy.generation_points[self.name]


class LanguageModel(GeneratingModel, Model):
    """A transformers causal language model (plus its tokenizer) ready for interventions."""

    logits = _logits_point("the [rows, vocab] next-token logits. In a generation: the scores the next token is "
                           "chosen from, after every other logits processor; in a trace: the last position of "
                           "lm_head's output (the last real token of each prompt). Edit in place or assign "
                           "`m.logits = new`")
    tokens = generation_point("generation only: the [rows] token ids chosen at this step (read-only)")

    #: ``(test, subclass)``: ``LanguageModel(model)`` makes ``subclass`` when ``test(model)`` holds (registered by
    #: the modules that define them, e.g. ``.lora`` for peft models; ``ai.LanguageModel`` imports those)
    _variants = []

    def __new__(cls, model=None, *args, **kwargs):
        if cls is LanguageModel:
            for test, variant in cls._variants:
                if test(model):
                    cls = variant
                    break
            else:
                if type(model).__module__.startswith("peft."):
                    raise TypeError("a peft model needs asyncinterp.models.hf.lora (ai.LanguageModel imports it): "
                                    "`import asyncinterp.models.hf.lora` first, or use ai.LanguageModel")
                if isinstance(getattr(model, "tp_size", None), int) and model.tp_size > 1 and not any(
                        v.__name__ == "ShardedLanguageModel" for _, v in cls._variants):
                    raise TypeError("a model sharded by its tensor-parallel plan needs asyncinterp.models.hf.tp "
                                    "(ai.LanguageModel imports it; without it awaits would see this rank's "
                                    "shards): `import asyncinterp.models.hf.tp` first, or use ai.LanguageModel")
        return super().__new__(cls)

    def __init__(self, model, tokenizer=None, envoys: dict | None = None):
        if not hasattr(model, "config"):
            raise TypeError(f"LanguageModel wraps a transformers model (with a .config), got "
                            f"{type(model).__name__}; use ai.wrap(module) for any other torch module")
        Model.__init__(self, model, envoys=envoys)
        init = object.__setattr__
        init(self, "tokenizer", tokenizer)
        init(self, "generation_points", make_taps(self))        #: ``logits``, ``tokens`` (tap points, see .taps)
        init(self, "context_length", context_length(model.config))
        init(self, "takes_position_ids", "position_ids" in inspect.signature(model.forward).parameters)
        init(self, "_engines", None)

    @classmethod
    def from_pretrained(cls, path, tokenizer=None, **hf_kwargs) -> "LanguageModel":
        """Load a causal LM (``AutoModelForCausalLM``) and its tokenizer from ``path`` (a directory or hub id).

        ``hf_kwargs`` go to ``from_pretrained`` (e.g. ``dtype=torch.float32``,
        ``attn_implementation="eager"`` to get attention weights). The model is
        put in eval mode.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained(path, **hf_kwargs).eval()
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(path)
        return cls(model, tokenizer)

    # ------------------------------------------------------------------ engines
    def engine(self, kind: str = "trace"):
        """The engine of this model's jobs of ``kind``: ``"trace"`` (one padded forward) or ``"generate"``."""
        engines = self._engines
        if engines is None or engines["trace"].model is not self:   # (a copy made by model.edit gets its own)
            engines = {"trace": LMForwardEngine(self), "generate": LMGenerateEngine(self)}
            object.__setattr__(self, "_engines", engines)
        try:
            return engines[kind]
        except KeyError:
            raise ValueError(f"a LanguageModel runs jobs of kind 'trace' or 'generate', not {kind!r}") from None

    # ------------------------------------------------------ inside a run only
    @property
    def generated(self):
        """Inside a generation task: what this invoke has generated so far (``.tokens``, ``.text``)."""
        run = current_run()
        task = current_task()
        if task is None or not isinstance(run, GenerateRun) or run.model is not self:
            raise NotInRunError("m.generated is only available inside an intervention of model.generate")
        return run.generated(task.group)

    # --------------------------------------------------------------- helpers
    def _tok(self):
        if self.tokenizer is None:
            raise ValueError("this LanguageModel has no tokenizer; pass one: LanguageModel(model, tokenizer)")
        return self.tokenizer
