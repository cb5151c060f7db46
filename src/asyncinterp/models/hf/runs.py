"""The engines of a language model and their runs: one forward pass (``LMRun``) or a generation (``GenerateRun``).

:class:`LMForwardEngine` and :class:`LMGenerateEngine` take jobs of kind
``"trace"`` and ``"generate"``; each makes the run that hosts the kernel
while the forward (or ``generate``) executes. Both runs tokenise and left-pad the invokes' prompts into one batch and slice it
with a padding-aware layout (see :mod:`.padding`), so each invoke sees what
its prompt alone would produce. A generation also

* makes every forward pass after the first a new kernel step, and moves the
  layout along (decode passes see one new position and a longer past);
* routes the next-token scores and the chosen ids through the ``m.logits``
  and ``m.tokens`` tap points (see :mod:`.taps`);
* records the sequences after every step, so a stopped generation still
  returns what it produced;
* takes options beside transformers' own: ``logprobs``/``prompt_logprobs`` (raw
  log-probabilities as vLLM reports them, see :mod:`.logprobs`), ``ignore_eos``
  (vLLM's: the end-of-sequence token does not end a row), ``stop`` (strings: a row ends
  at the step whose token completes one of them, as in vLLM), ``seed``
  (each invoke samples from its own generator, seeded with it, see :mod:`.sampling`) and
  ``presence_penalty``/``frequency_penalty`` (vLLM's rule over the generated
  tokens, see :mod:`.penalties`).
"""

from __future__ import annotations

import contextlib

import torch

from ...kernel.errors import NotInRunError
from ...engine import describe_invoke
from ...hooks.batching import forward_kwargs
from ...hooks.keywords import check_forward_kwargs
from ...run import Run
from ..generating import Generated, GeneratedInvoke, check_stop, eos_ids, stop_hit
from .inputs import build_batch, check_length, pad_id_of
from .logprobs import LogprobRecorder, check_count
from .padding import PaddedLayout
from .penalties import OutputPenalties
from .sampling import SEEDS, InvokeSampler, sampling_warpers
from .taps import logits_processor, rank_of, stopping_criteria


def _device_of(module):
    for p in module.parameters():
        return p.device
    return None


class LMForwardEngine:
    """Takes ``"trace"`` jobs of a :class:`~asyncinterp.models.hf.language.LanguageModel`: one padded forward."""

    def __init__(self, model):
        self.model = model

    make_invoke = staticmethod(describe_invoke)

    def start(self, job) -> "LMRun":
        return LMRun(self.model, job)


class LMGenerateEngine(LMForwardEngine):
    """Takes ``"generate"`` jobs of a language model: transformers' ``generate``, one kernel step per pass."""

    def make_invoke(self, index, input, fns, kwargs, deferred):
        if kwargs:
            raise TypeError(f"generation invokes take no keyword arguments (got {sorted(kwargs)}); pass "
                            "generation options to model.generate(...)")
        return describe_invoke(index, input, fns, kwargs, deferred, Generation)

    def start(self, job) -> "GenerateRun":
        return GenerateRun(self.model, job)


class LMRun(Run):
    """The kernel's host for one forward pass of a :class:`~asyncinterp.models.hf.language.LanguageModel`."""

    generating = False

    def __init__(self, model, job):
        super().__init__(model, job)
        self.batch = None

    # ---------------------------------------------------------------- kernel host
    def activate(self, trap, task) -> None:
        if rank_of(trap) and not self.generating:
            raise NotInRunError(
                f"m.{trap.describe()} fires only during generation (model.generate / agenerate); in a trace "
                "read the logits with `await m.lm_head.output` instead")
        super().activate(trap, task)

    def already_ran(self, trap, current_point) -> bool:
        # within a step: all modules, then m.logits, then m.tokens
        mine, now = rank_of(trap), rank_of(current_point)
        if mine or now:
            return mine < now
        return super().already_ran(trap, current_point)

    # ---------------------------------------------------------------- forward
    def _batch(self, extra_tokens: int = 0):
        lm = self.model
        module = lm.module
        batch = build_batch([inv.spec.input for inv in self.invokes], lm.tokenizer, _device_of(module))
        check_length([p for p in batch.prompts if p is not None], lm.context_length, extra_tokens)
        self.batch = batch
        self.layout = batch.layout
        return batch

    def prepare(self):
        """Build the batch and layout; return the callable that runs the forward pass."""
        batch = self._batch()
        lm = self.model
        call = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
        if lm.takes_position_ids:
            call["position_ids"] = batch.position_ids
        module = lm.module
        extra = forward_kwargs(self.invokes)
        if extra:
            check_forward_kwargs(module, extra)     # unknown keywords are refused, never dropped (issue 33)
            call.update(extra)
        return lambda: module(**call)


class Generation(GeneratedInvoke):
    """An invoke of a generation: its intervention's result plus what was generated for it (through the first eos)."""

    repr_name = "Generation invoke"

    @property
    def sequences(self) -> torch.Tensor:
        """This invoke's rows of the full ``[rows, prompt + new]`` id tensor (left padded)."""
        run = self.run
        seq = run.sequences_so_far()
        span = run.batch.spans[self.index] if run.batch is not None else None
        return seq if span is None else seq[span[0]:span[1]]

    def generated_so_far(self) -> Generated:
        return self.run.generated(self.index)

    @property
    def logprobs(self):
        """With the ``logprobs=k`` option: per generated token (of this invoke's first prompt), ``{token id:
        log-prob}`` of the chosen token then the ``k`` most likely (raw model log-probabilities, as vLLM's
        ``SamplingParams(logprobs=k)``); ``None`` without the option."""
        return self.run.logprobs_of(self.index, len(self.generated_so_far_tokens()))

    @property
    def prompt_logprobs(self):
        """With ``prompt_logprobs=k``: per prompt token, ``None`` for the first, then ``{token id: log-prob}``
        of that token then the ``k`` most likely (as vLLM's ``SamplingParams(prompt_logprobs=k)``)."""
        return self.run.prompt_logprobs_of(self.index)

    def logprob_at(self, i):
        """The logprobs entry of generated token ``i`` (``None`` if not recorded)."""
        rec = self.run.recorder
        if rec is None or rec.top is None or i >= len(rec.steps):
            return None
        span = self.run.batch.spans[self.index]
        return rec.steps[i][span[0] if span is not None else 0]

    def generated_so_far_tokens(self):
        tokens = self.generated_so_far().tokens
        return tokens[0] if isinstance(tokens, list) else tokens


class GenerateRun(LMRun):
    """The kernel's host for a generation (``model.generate``): one kernel step per forward pass."""

    generating = True

    def __init__(self, model, job):
        super().__init__(model, job)
        self.generate_kwargs = dict(job.generation)
        self._sequences = None
        self._eos = ()
        self._stops = ()
        self.recorder = None     # LogprobRecorder with the logprobs / prompt_logprobs options

    # ---------------------------------------------------------------- results
    def sequences_so_far(self) -> torch.Tensor:
        if self._sequences is not None:
            return self._sequences
        return self.batch.input_ids

    def generated(self, group) -> Generated:
        """What invoke ``group`` has generated so far."""
        batch = self.batch
        seq = self.sequences_so_far()
        span = batch.spans[group]
        new = seq[:, batch.input_ids.shape[1]:]
        if span is not None:
            new = new[span[0]:span[1]]
        tok = self.model.tokenizer
        rows = [self._until_end(r, tok) for r in new]
        texts = None if tok is None else [tok.decode(r.tolist(), skip_special_tokens=True) for r in rows]
        prompt = batch.prompts[group]
        if prompt is not None and prompt.single:
            return Generated(rows[0], None if texts is None else texts[0])
        return Generated(rows, texts)

    def _until_end(self, row, tokenizer):
        """``row`` through its first end-of-sequence token or the token that completes a stop string."""
        if self._eos and row.numel():
            hits = torch.zeros_like(row, dtype=torch.bool)
            for e in self._eos:
                hits |= row == e
            idx = hits.nonzero()
            if len(idx):
                row = row[: int(idx[0]) + 1]
        if self._stops and tokenizer is not None:
            ids = row.tolist()
            for i in range(len(ids)):
                if stop_hit(tokenizer.decode(ids[: i + 1], skip_special_tokens=True), self._stops):
                    row = row[: i + 1]
                    break
        return row.clone()

    def _record(self, input_ids):
        self._sequences = input_ids
        if self.recorder is not None:
            self.recorder.on_tokens(input_ids)

    def logprobs_of(self, group, count):
        """Invoke ``group``'s generated-token logprobs (its first row), through ``count`` tokens."""
        if self.recorder is None or self.batch is None:
            return None
        span = self.batch.spans[group]
        return self.recorder.generated(span[0] if span is not None else 0, count)

    def prompt_logprobs_of(self, group):
        if self.recorder is None or self.batch is None:
            return None
        span = self.batch.spans[group]
        return self.recorder.prompt_of(span[0] if span is not None else 0)

    # ---------------------------------------------------------------- forward
    def _on_step(self, step, args, kwargs):
        layout = self.layout
        if isinstance(layout, PaddedLayout):
            ids = kwargs.get("input_ids")
            if ids is None and args:
                ids = args[0]
            new = ids.shape[1] if ids is not None else 1
            layout.set_step(new, layout.key_len + new)

    def prepare(self):
        lm = self.model
        kw = dict(self.generate_kwargs)
        for name in ("num_beams", "num_return_sequences"):
            if (kw.get(name) or 1) > 1:
                raise ValueError(f"{name}={kw[name]} is not supported: asyncinterp generation keeps one row per "
                                 "prompt so that each invoke's rows stay its own (use several invokes instead)")
        new_tokens = kw.get("max_new_tokens") or 0
        batch = self._batch(extra_tokens=new_tokens)
        module = lm.module
        self._stops = check_stop(kw.pop("stop", None))
        seed = kw.pop("seed", None)
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise TypeError(f"seed must be an int, got {seed!r}")
        top = check_count("logprobs", kw.pop("logprobs", None))
        prompt_top = check_count("prompt_logprobs", kw.pop("prompt_logprobs", None))
        recorder = None
        if top is not None or prompt_top is not None:
            lengths = [int(n) for n in batch.attention_mask.sum(dim=1).tolist()]
            recorder = self.recorder = LogprobRecorder(top, prompt_top, batch.input_ids, lengths)
            kw.update(recorder.generate_kwargs(module))
        if kw.pop("ignore_eos", False):
            # vLLM's ignore_eos: the end-of-sequence token does not end a row (stop_token_ids still do)
            kw["eos_token_id"] = kw.get("eos_token_id") or None
        kw.setdefault("do_sample", False)
        kw.setdefault("pad_token_id", pad_id_of(lm.tokenizer))
        self._eos = eos_ids(kw["eos_token_id"] if "eos_token_id" in kw else module)
        taps = lm.generation_points
        from transformers import LogitsProcessorList, StoppingCriteriaList
        processors = LogitsProcessorList(list(kw.pop("logits_processor", None) or []))
        presence, frequency = kw.pop("presence_penalty", 0.0), kw.pop("frequency_penalty", 0.0)
        if presence or frequency:
            processors.append(OutputPenalties(batch.input_ids.shape[1], presence, frequency))
        processors.append(logits_processor(taps["logits"].envoy.module))
        if kw["do_sample"]:
            # each invoke samples from its own generator (see .sampling); transformers then takes the drawn token
            processors.extend(sampling_warpers(module, kw))
            seeds = self._context.get(SEEDS) if self._context else None
            processors.append(InvokeSampler.for_batch(batch.spans, batch.input_ids.shape[0], seeds, seed))
            kw["do_sample"] = False
        criteria = StoppingCriteriaList(list(kw.pop("stopping_criteria", None) or []))
        criteria.append(stopping_criteria(taps["tokens"].envoy.module, self._record))
        if self._stops:
            criteria.append(stop_strings_criteria(lm.tokenizer, self._stops, batch.input_ids.shape[1]))

        def forward():
            self.track_steps(module, on_step=self._on_step)
            handle = None if recorder is None else module.register_forward_hook(recorder.hook)
            try:
                with _seeded(seed, batch.input_ids.device):
                    return module.generate(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                           logits_processor=processors, stopping_criteria=criteria, **kw)
            finally:
                if handle is not None:
                    handle.remove()
        return forward


@contextlib.contextmanager
def _seeded(seed, device):
    """Sampling in the block draws from ``torch.manual_seed(seed)``; the caller's RNG state is restored after."""
    if seed is None:
        yield
        return
    devices = [device] if device is not None and device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def stop_strings_criteria(tokenizer, stops, prompt_len):
    """A ``StoppingCriteria``: a row is done once its generated text contains one of ``stops``."""
    from transformers import StoppingCriteria

    class _StopStrings(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            done = [stop_hit(tokenizer.decode(row[prompt_len:].tolist(), skip_special_tokens=True), stops)
                    for row in input_ids]
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    return _StopStrings()
