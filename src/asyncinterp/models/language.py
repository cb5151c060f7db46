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

from ..kernel.errors import NotInRunError
from ..kernel.scheduler import current_kernel, current_task
from ..model import Model
from .inputs import context_length
from .runs import GenerateRun, Generation, LMRun
from .taps import make_taps, tap

_NOTHING = object()


class LanguageModel(Model):
    """A transformers causal language model (plus its tokenizer) ready for interventions."""

    logits = tap("generation only: the [rows, vocab] scores the next token is chosen from, after every "
                 "other logits processor; edit in place or assign `m.logits = new` to change the choice")
    tokens = tap("generation only: the [rows] token ids chosen at this step (read-only)")

    def __init__(self, model, tokenizer=None, envoys: dict | None = None):
        if not hasattr(model, "config"):
            raise TypeError(f"LanguageModel wraps a transformers model (with a .config), got "
                            f"{type(model).__name__}; use ai.wrap(module) for any other torch module")
        Model.__init__(self, model, envoys=envoys)
        d = self.__dict__
        d["tokenizer"] = tokenizer
        d["_taps"] = make_taps(self)
        d["context_length"] = context_length(model.config)
        d["_takes_position_ids"] = "position_ids" in inspect.signature(model.forward).parameters

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

    # ------------------------------------------------------------------ runs
    def _new_run(self, **options) -> LMRun:
        return LMRun(self, **options)

    def _prepare(self, run):
        return run.prepare()

    def generate(self, input=_NOTHING, *fns, max_new_tokens: int = 20, on_error: str = "stop",
                 **generate_kwargs):
        """Generate with interventions; the task's steps are the forward passes.

        ``model.generate(prompt, fn, max_new_tokens=20)`` runs ``fn(m)`` beside
        ``hf_model.generate`` and returns a :class:`Generation` (``.result``,
        ``.tokens``, ``.text``). ``model.generate(max_new_tokens=...)`` with no
        prompt returns the run to fill in a ``with`` block
        (``gen.invoke(prompt, fn)`` per prompt). Decoding is greedy unless
        ``do_sample=True`` is passed; other keywords go to transformers'
        ``generate``.
        """
        run = self._generation(max_new_tokens, on_error, generate_kwargs)
        if input is _NOTHING and not fns:
            return run
        inv = run.invoke(None if input is _NOTHING else input, *fns)
        run.run()
        return inv

    async def agenerate(self, input=_NOTHING, *fns, max_new_tokens: int = 20, on_error: str = "stop",
                        **generate_kwargs) -> Generation:
        """:meth:`generate` for async code: runs in a worker thread; cancelling stops it at the next hook point."""
        from ..aio import run_in_thread
        if input is _NOTHING:
            raise TypeError("agenerate needs a prompt; for several prompts use "
                            "`async with model.generate(...) as gen:` and gen.invoke(...)")
        run = self._generation(max_new_tokens, on_error, generate_kwargs)
        inv = run.invoke(input, *fns)
        await run_in_thread(self, run)
        return inv

    def _generation(self, max_new_tokens, on_error, kwargs) -> GenerateRun:
        if max_new_tokens is not None and (not isinstance(max_new_tokens, int) or max_new_tokens < 1):
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        return GenerateRun(self, dict(kwargs, max_new_tokens=max_new_tokens), on_error=on_error)

    # ------------------------------------------------------ inside a run only
    @property
    def generated(self):
        """Inside a generation task: what this invoke has generated so far (``.tokens``, ``.text``)."""
        kernel = current_kernel()
        task = current_task()
        if kernel is None or task is None or not isinstance(kernel.host, GenerateRun) \
                or kernel.host.model is not self:
            raise NotInRunError("m.generated is only available inside an intervention of model.generate")
        return kernel.host.generated(task.group)

    # --------------------------------------------------------------- helpers
    def to_tokens(self, text: str) -> list:
        """Token ids of ``text`` with this model's tokenizer (no special tokens added)."""
        return list(self._tok()(text, add_special_tokens=False)["input_ids"])

    def token_id(self, text: str) -> int:
        """The id of ``text``, which must be exactly one token (e.g. ``" Paris"``)."""
        ids = self.to_tokens(text)
        if len(ids) != 1:
            raise ValueError(f"{text!r} is {len(ids)} tokens ({ids}), not one")
        return ids[0]

    def decode(self, ids) -> str:
        """Text of token ids (a list or tensor)."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        return self._tok().decode(ids)

    def _tok(self):
        if self.tokenizer is None:
            raise ValueError("this LanguageModel has no tokenizer; pass one: LanguageModel(model, tokenizer)")
        return self.tokenizer
