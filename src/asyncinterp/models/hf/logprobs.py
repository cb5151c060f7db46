"""Log-probabilities of a transformers generation: each generated token's, and the prompt's, as vLLM reports them.

Why this module exists: a generation with the ``logprobs=k`` option (and
``prompt_logprobs=k``) must give what vLLM's ``SamplingParams`` of the same
names give, so that the server answers the same numbers on both engines
and a user can compare them. vLLM 0.32 reports *raw* log-probabilities by
default (``logprobs_mode="raw_logprobs"``): the log-softmax of the model's
own logits, before temperature, penalties, ``logit_bias`` or any sampling
filter. So this recorder reads the model's output logits (a forward hook on
the causal-LM module, which runs *after* every hook of the model's own
modules, so an intervention's edits are in them) and never the scores that
transformers' logits processors produce.

The format is vLLM's: one entry per position, a ``{token id: log-prob}``
dict whose first key is the token at that position (the chosen token, or the
prompt's token), followed by the ``k`` most likely tokens in order (a token
among them appears once, where it came first). A prompt's first position has
no entry (``None``).
"""

from __future__ import annotations

import inspect

import torch

__all__ = ["LogprobRecorder", "check_count"]


def check_count(name, value):
    """``value`` of option ``name`` (``logprobs``/``prompt_logprobs``): ``None``, or an int >= 0."""
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise TypeError(f"{name} must be a non-negative int (how many top tokens to report), got {value!r}")
    return value


def takes_logits_to_keep(module) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


class LogprobRecorder:
    """Records raw log-probabilities during one ``generate`` call of a left-padded batch.

    ``top``: how many top tokens to report per generated token (``None``: no
    generated logprobs); ``prompt_top``: the same for the prompt (``None``:
    no prompt logprobs; the first forward must then produce logits for every
    position, see :meth:`generate_kwargs`). ``input_ids``: the padded batch
    (``[rows, prompt]``), ``lengths``: each row's prompt length.
    """

    def __init__(self, top, prompt_top, input_ids, lengths):
        self.top = top
        self.prompt_top = prompt_top
        self.input_ids = input_ids
        self.lengths = lengths
        self.steps = []          # per step: per row, the entry of the token generated at that step
        self.prompt = None       # per row: [None, entry, ...] for its prompt tokens
        self._last = None        # log-probs of the newest position, until its token is chosen

    def generate_kwargs(self, module) -> dict:
        """Extra ``generate`` keywords: logits for every prompt position on the first pass (when needed)."""
        if self.prompt_top is not None and takes_logits_to_keep(module):
            return {"logits_to_keep": 0}
        return {}

    def hook(self, module, args, output):
        """Forward hook of the causal-LM module: the logits of this pass."""
        logits = getattr(output, "logits", None)
        if logits is None and isinstance(output, (tuple, list)):
            logits = output[0]
        if not isinstance(logits, torch.Tensor):
            return None
        with torch.no_grad():
            last = torch.log_softmax(logits[:, -1].float(), dim=-1)
            if self.prompt is None and self.prompt_top is not None:
                self.prompt = self._prompt_entries(logits)
            self._last = last
        return None

    def on_tokens(self, input_ids) -> None:
        """The tokens chosen from the newest position (``input_ids``: the sequences so far)."""
        lp = self._last
        if lp is None or self.top is None:
            return
        self._last = None
        chosen = input_ids[:, -1].to(lp.device)
        self.steps.append(_entries(lp, chosen, self.top))

    def _prompt_entries(self, logits):
        ids = self.input_ids
        width = ids.shape[1]
        if logits.shape[1] != width:
            raise RuntimeError(f"prompt logprobs need the logits of every prompt position; the model gave "
                               f"{logits.shape[1]} of {width}")
        lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)        # position t predicts token t + 1
        rows = []
        for r, n in enumerate(self.lengths):
            start = width - n
            if n < 2:
                rows.append([None] * n)
                continue
            targets = ids[r, start + 1:].to(lp.device)
            rows.append([None] + _entries(lp[r, start:width - 1], targets, self.prompt_top))
        return rows

    # ---------------------------------------------------------------- per invoke
    def generated(self, row, count):
        """The entries of ``row``'s first ``count`` generated tokens (``None`` without ``logprobs``)."""
        if self.top is None:
            return None
        return [step[row] for step in self.steps[:count]]

    def prompt_of(self, row):
        """``row``'s prompt entries (``None`` without ``prompt_logprobs``)."""
        if self.prompt_top is None or self.prompt is None:
            return None
        return self.prompt[row]


def _entries(lp, chosen, top):
    """Per row of ``lp`` (``[rows, vocab]`` log-probs): ``{chosen: lp, top-k...}`` as vLLM orders them."""
    chosen_lp = lp.gather(-1, chosen.view(-1, 1)).view(-1).tolist()
    chosen = chosen.tolist()
    if top:
        vals, idx = torch.topk(lp, min(top, lp.shape[-1]), dim=-1)
        vals, idx = vals.tolist(), idx.tolist()
    else:
        vals = idx = [[] for _ in chosen]
    out = []
    for c, c_lp, ti, tv in zip(chosen, chosen_lp, idx, vals):
        entry = {int(c): float(c_lp)}
        for t, v in zip(ti, tv):
            entry.setdefault(int(t), float(v))
        out.append(entry)
    return out
