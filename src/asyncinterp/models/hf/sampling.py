"""Sampling with one random generator per invoke: an invoke's draws depend on its own seed only.

transformers samples every row of a batch with ``torch.multinomial`` from
torch's global generator, so a row's tokens depend on which rows share its
batch and on any code that draws from that generator meanwhile (an
intervention calling ``torch.rand``). Served generations share batches
between tenants, and a seed must mean the same tokens whoever else is on the
server (as vLLM's per-request generators do). So a sampling generation draws
here instead: the sampling warpers transformers would apply (temperature,
top-k, top-p, ...) run first, then :class:`InvokeSampler` draws each
invoke's rows from that invoke's own ``torch.Generator`` and hands
transformers scores in which the drawn token is the only choice, which its
greedy step then takes.

An invoke's seed is, in order: its own (``run.context[SEEDS][index]``; the
serving batcher gives every request one), the job's ``seed`` option, or one
drawn from torch's global generator when the run starts (so
``torch.manual_seed(0)`` before an unseeded local generation still makes it
reproducible).
"""

from __future__ import annotations

import torch

from ..generating import SEEDS

__all__ = ["SEEDS", "InvokeSampler", "sampling_warpers"]


#: transformers' sampling options, in the order its own generate applies their warpers
_WARPER_OPTIONS = ("temperature", "top_h", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")


def sampling_warpers(module, kw: dict) -> list:
    """The warpers transformers' ``generate`` adds for sampling (its own classes, in its order, under its
    conditions), from ``kw`` over the model's generation config; the sampling options are taken out of ``kw``."""
    import copy

    import transformers as tf

    config = copy.deepcopy(module.generation_config)
    for name in _WARPER_OPTIONS:
        if name in kw:
            setattr(config, name, kw.pop(name))
    warpers = []
    if config.temperature is not None and config.temperature != 1.0:
        warpers.append(tf.TemperatureLogitsWarper(config.temperature))
    if getattr(config, "top_h", None) is not None:
        warpers.append(tf.TopHLogitsWarper(top_h=config.top_h))
    if config.top_k is not None and config.top_k != 0:
        warpers.append(tf.TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
    if config.top_p is not None and config.top_p < 1.0:
        warpers.append(tf.TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
    if config.min_p is not None:
        warpers.append(tf.MinPLogitsWarper(min_p=config.min_p, min_tokens_to_keep=1))
    if config.typical_p is not None and config.typical_p < 1.0:
        warpers.append(tf.TypicalLogitsWarper(mass=config.typical_p, min_tokens_to_keep=1))
    if config.epsilon_cutoff is not None and 0.0 < config.epsilon_cutoff < 1.0:
        warpers.append(tf.EpsilonLogitsWarper(epsilon=config.epsilon_cutoff, min_tokens_to_keep=1))
    if config.eta_cutoff is not None and 0.0 < config.eta_cutoff < 1.0:
        warpers.append(tf.EtaLogitsWarper(epsilon=config.eta_cutoff, min_tokens_to_keep=1))
    return warpers


class InvokeSampler:
    """A logits processor: draws each invoke's rows from its own generator; the drawn token is the only choice."""

    def __init__(self, segments):
        self.segments = segments     # [(start, stop, seed)] covering the batch's rows
        self.generators = None

    @classmethod
    def for_batch(cls, spans, rows: int, seeds: dict, job_seed):
        """One segment per invoke with rows (``spans[i]``: its ``(start, stop)`` or ``None``)."""
        segments = []
        for index, span in enumerate(spans):
            if span is None or span[1] <= span[0]:
                continue
            seed = seeds.get(index) if seeds else None
            if seed is None:
                seed = job_seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, ()).item())   # torch's global generator: torch.manual_seed holds
            segments.append((int(span[0]), int(span[1]), int(seed)))
        if sum(stop - start for start, stop, _ in segments) != rows:
            seed = job_seed if job_seed is not None else int(torch.randint(0, 2**62, ()).item())
            segments = [(0, rows, int(seed))]   # one invoke owns the whole batch
        return cls(segments)

    def __call__(self, input_ids, scores):
        if self.generators is None:
            self.generators = [torch.Generator(device=scores.device).manual_seed(seed) for _, _, seed in self.segments]
        probs = torch.softmax(scores.float(), dim=-1)
        chosen = torch.full_like(scores, float("-inf"))
        for (start, stop, _), generator in zip(self.segments, self.generators):
            ids = torch.multinomial(probs[start:stop], 1, generator=generator)
            chosen[start:stop].scatter_(1, ids, 0.0)
        return chosen
