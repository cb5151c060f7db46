"""Generation hook points that are not modules: the next-token logits and the chosen tokens.

``generate`` computes the scores it samples from, and picks the tokens, outside
any ``nn.Module``. To make them ordinary awaitable hook points, the run routes
them through two tiny identity modules: a ``LogitsProcessor`` calls the
logits tap with the final scores of each step (after every other processor,
so an edit decides the choice), and a ``StoppingCriteria`` calls the tokens
tap with the ids just chosen. Hooks on these modules are installed lazily
like any other, so a generation nobody taps pays two no-op calls per step.

Within a step the order is: every module of the model, then ``m.logits``,
then ``m.tokens``. The run uses the ``rank`` of these points to report an
out-of-order await at once instead of letting it miss.
"""

from __future__ import annotations

import torch

from ...hooks.envoy import Envoy, HookPoint
from ...kernel.errors import ReplacementError


class _Identity(torch.nn.Module):
    """A module that returns its input: something hooks can attach to."""

    def forward(self, value):
        return value


class LogitsTapModule(_Identity):
    """Called with ``[batch, vocab]`` next-token scores once per generation step."""


class TokensTapModule(_Identity):
    """Called with the ``[batch]`` token ids chosen at each generation step."""


class TapPoint(HookPoint):
    """A hook point on a tap module, described by its own name (``logits``, ``tokens``)."""

    __slots__ = ("label", "rank")

    def __init__(self, envoy, label: str, rank: int):
        HookPoint.__init__(self, envoy, "output")
        self.label = label
        self.rank = rank

    def describe(self) -> str:
        return self.label


def make_taps(root) -> dict:
    """The tap points of a language model envoy ``root``: ``{"logits": ..., "tokens": ...}``."""
    logits = Envoy(LogitsTapModule(), "logits", root=root)
    tokens = Envoy(TokensTapModule(), "tokens", root=root)
    return {"logits": TapPoint(logits, "logits", 1), "tokens": TapPoint(tokens, "tokens", 2)}


def rank_of(hook_point) -> int:
    """0 for a module's hook point, 1 for the logits tap, 2 for the tokens tap."""
    return getattr(hook_point, "rank", 0)


def logits_processor(module):
    """A ``LogitsProcessor`` that routes each step's scores through ``module``."""
    from transformers import LogitsProcessor

    class _LogitsTap(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return module(scores)

    return _LogitsTap()


def stopping_criteria(module, record):
    """A ``StoppingCriteria`` that records the sequences and routes the new tokens through ``module``."""
    from transformers import StoppingCriteria

    class _TokensTap(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            record(input_ids)
            chosen = input_ids[:, -1].clone()
            if module(chosen) is not chosen:
                raise ReplacementError(
                    "m.tokens is read-only (the token was already appended); to choose a different token, "
                    "edit or replace m.logits at the same step")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return _TokensTap()
