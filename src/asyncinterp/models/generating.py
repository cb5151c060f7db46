"""Entry points, token helpers and invoke results shared by every generating model (transformers, vLLM).

``generate``/``agenerate`` build a job of kind ``"generate"`` (its
``generation`` options: ``max_new_tokens`` and the rest) and hand it to the
model's ``engine("generate")`` — the one thing each model supplies;
``to_tokens``/``token_id``/``decode`` use ``self._tok()``.
An invoke of a generation is a :class:`GeneratedInvoke`: its result plus what
was generated for it (``.tokens``, ``.text``, ``.stopped``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from ..hooks.envoy import point
from ..invoke import Invoke
from ..job import Trace

_NOTHING = object()

#: ``run.context`` key of ``{invoke index: seed}``: each invoke of a generation samples from a generator of its
#: own, seeded so (the serving batcher gives every request one; see :mod:`asyncinterp.models.hf.sampling`)
SEEDS = "generation.seeds"


class generation_point(point):
    """Descriptor for a model-level point of a generating model (``m.logits``, ``m.tokens``).

    The point lives on a module outside the model's tree (a tap module, the
    sampler); the root envoy keeps it in ``generation_points`` by name.
    Assignable like any point (``m.logits = t``).
    """

    def __init__(self, doc: str):
        point.__init__(self, base="output", doc=doc)

    def __get__(self, envoy, owner=None):
        if envoy is None:
            return self
        return envoy.generation_points[self.name]


@dataclass
class Generated:
    """Tokens generated so far for one invoke (``m.generated`` inside a task, or on the result).

    ``tokens``: a 1-D LongTensor (a list of them for several prompts in one
    transformers invoke); ``text``: a str (a list of them), or ``None``
    without a tokenizer.
    """

    tokens: object
    text: object


class GeneratedInvoke(Invoke):
    """An invoke of a generation: its intervention's result plus what was generated for it.

    Subclasses supply :meth:`generated_so_far`; ``repr_name`` names them in ``repr``.
    """

    repr_name = "GeneratedInvoke"
    keeps_run = True   # tokens and text are read from the run afterwards

    @property
    def result(self):
        """The intervention's return value (``None`` without one; a tuple for several)."""
        if not self.fns:
            if not self.done:
                raise RuntimeError("the generation has not run yet")
            return None
        return Invoke.result.fget(self)

    @property
    def tokens(self):
        """Generated token ids: a 1-D LongTensor (a list of them for several prompts in one invoke)."""
        return self.generated().tokens

    @property
    def text(self):
        """Generated text (special tokens skipped): a string (a list of them for several prompts)."""
        return self.generated().text

    @property
    def stopped(self) -> bool:
        """Whether the generation was stopped early (``m.stop()``) rather than ending by itself."""
        return self.run.stopped

    def generated(self) -> Generated:
        """What this invoke generated (after the run)."""
        self.check_done()
        return self.generated_so_far()

    def generated_so_far(self) -> Generated:
        raise NotImplementedError

    def check_done(self) -> None:
        """Raise ``RuntimeError`` unless the run has executed."""
        if not self.done:
            raise RuntimeError("the generation has not run yet; leave the `with model.generate(...)` block first")

    def __repr__(self):
        if not self.done:
            return f"<{self.repr_name} {self.index} (not run)>"
        return f"<{self.repr_name} {self.index} text={self.text!r}>"


class GeneratingModel:
    """Mixin for a :class:`~asyncinterp.model.Model` that generates text step by step."""

    def generate(self, input=_NOTHING, *fns, max_new_tokens: int = 20, on_error: str = "stop", **options):
        """Generate with interventions; each forward pass (engine step) is one step of the tasks.

        ``model.generate(prompt, fn, max_new_tokens=20)`` returns the invoke's
        result object (``.result``, ``.tokens``, ``.text``).
        ``model.generate(max_new_tokens=...)`` without a prompt returns the trace
        for a ``with`` block (``tr.invoke(prompt, fn)`` per prompt). Decoding
        is greedy unless sampling keywords say otherwise; other keywords go to
        the model's own generation call. Both engines take ``stop`` (a string
        or a list: a prompt's generation ends at the token that completes one
        of them) and ``seed`` (sampling).
        """
        tr = Trace(self, "generate", on_error,
                    generation=dict(options, max_new_tokens=_checked_max_new_tokens(max_new_tokens)))
        if input is _NOTHING and not fns:
            return tr
        inv = tr.invoke(None if input is _NOTHING else input, *fns)
        tr.run()
        return inv

    async def agenerate(self, input=_NOTHING, *fns, max_new_tokens: int = 20, on_error: str = "stop", **options):
        """:meth:`generate` for async code: runs in a worker thread; cancelling stops it at the next step."""
        from ..aio import run_in_thread
        if input is _NOTHING:
            raise TypeError("agenerate needs a prompt; for several prompts use "
                            "`async with model.generate(...) as tr:` and tr.invoke(...)")
        tr = Trace(self, "generate", on_error,
                    generation=dict(options, max_new_tokens=_checked_max_new_tokens(max_new_tokens)))
        inv = tr.invoke(input, *fns)
        await run_in_thread(tr.start())
        return inv

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
        """Text of token ids (an int, a list or a tensor)."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        return self._tok().decode(ids)

    def _tok(self):
        return self.tokenizer


def _checked_max_new_tokens(n):
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ValueError(f"max_new_tokens must be a positive int, got {n!r}")
    return n


def check_stop(stop) -> tuple:
    """The ``stop`` generation option as a tuple of non-empty strings (``None``: no stop strings)."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise TypeError(f"stop must be a string or a list of non-empty strings, got {stop!r}")
    return tuple(stop)


def stop_hit(text: str, stops) -> bool:
    """Whether generated ``text`` contains one of the stop strings ``stops``."""
    return any(s in text for s in stops)


def eos_ids(model_or_config, tokenizer=None) -> tuple:
    """End-of-sequence token ids: those of a generation config, then the tokenizer's (each once, in order).

    ``model_or_config``: a wrapped model (``LanguageModel``, ``VLLM``: its
    torch module's ``generation_config``), a torch module, a generation
    config, the ids themselves (an int or a list of ints), or ``None``.
    ``tokenizer``: its ``eos_token_id`` is added when given.
    """
    source = model_or_config
    if not _is_ids(source):
        module = getattr(source, "module", source)         # a wrapped model: its torch module
        config = getattr(module, "generation_config", module)
        source = getattr(config, "eos_token_id", None)
    found = list(_ids_of(source)) + list(_ids_of(getattr(tokenizer, "eos_token_id", None)))
    return tuple(dict.fromkeys(found))


def _is_ids(value) -> bool:
    return value is None or isinstance(value, (list, tuple)) or hasattr(value, "__index__") or hasattr(
        value, "tolist")


def _ids_of(value) -> tuple:
    """``value`` (an id, a list of ids, or ``None``) as a tuple of ints; anything else holds none."""
    if hasattr(value, "tolist"):      # a tensor of ids
        value = value.tolist()
    values = value if isinstance(value, (list, tuple)) else (value,)
    return tuple(operator.index(v) for v in values if hasattr(v, "__index__"))
