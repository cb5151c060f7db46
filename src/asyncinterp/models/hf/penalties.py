"""Presence and frequency penalties for transformers generation (vLLM's and OpenAI's meaning).

Why this module exists: vLLM's server takes ``presence_penalty`` and
``frequency_penalty`` and transformers has no logits processor for them
(its ``repetition_penalty`` is a different, multiplicative rule). A
generation given either option (``model.generate(..., presence_penalty=0.5)``)
gets :class:`OutputPenalties` in its logits processors, so the serving layer
can give the transformers engine the same request fields as vLLM's.

The rule, as vLLM applies it: for every token the request has *generated*
so far (the prompt does not count), ``logit -= frequency_penalty * count +
presence_penalty * (count > 0)``.
"""

from __future__ import annotations

import math

import torch


def check_penalty(name: str, value) -> float:
    """A penalty as a float in [-2, 2] (vLLM's range), or ``TypeError``/``ValueError`` saying what is wrong."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or not -2.0 <= value <= 2.0:
        raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
    return float(value)


class OutputPenalties:
    """A transformers ``LogitsProcessor``: presence and frequency penalties over the generated tokens.

    ``prompt_len``: the width of the (padded) prompt batch; ids past it were generated.
    """

    def __init__(self, prompt_len: int, presence: float = 0.0, frequency: float = 0.0):
        self.prompt_len = int(prompt_len)
        self.presence = check_penalty("presence_penalty", presence)
        self.frequency = check_penalty("frequency_penalty", frequency)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[:, self.prompt_len:]
        if generated.shape[1] == 0:
            return scores
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)
