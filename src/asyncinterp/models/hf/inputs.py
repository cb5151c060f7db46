"""Prompts to token rows, and token rows to one left-padded batch.

An invoke's input may be a string, a list of strings, token ids (a list of
ints, a list of lists, a 1-D or 2-D tensor) or a tokenizer output (a mapping
with ``input_ids`` and optionally ``attention_mask``). Each becomes a list of
token-id rows; a row's padding (where an attention mask says so) is dropped,
so every prompt is re-padded consistently with the others in the run.

Handling of edge cases (documented in docs/language-models.md):

* an empty prompt (no tokens) is a ``ValueError``: a causal LM needs at least
  one token to predict from;
* a prompt longer than the model's context (``max_position_embeddings`` /
  ``n_positions``) is a ``ValueError`` naming both lengths;
* a tokenizer without a pad token is fine: padded positions are masked, so
  the pad id is never seen; the eos id (or 0) is used.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .padding import PaddedLayout
from ...hooks.views import BatchLayout, Layout


@dataclass
class Prompt:
    """One invoke's input as token rows; ``single`` if it was one prompt (not a list)."""

    rows: list
    single: bool


def _short(text, limit=60):
    text = repr(text)
    return text if len(text) <= limit else text[: limit - 4] + "...'"


def _ids_rows(ids, mask=None):
    """Rows of token ids from a list / nested list / tensor, dropping masked positions."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() == 0 or ids.dim() > 2:
            raise ValueError(f"token ids must be a 1-D or 2-D tensor, got shape {tuple(ids.shape)}")
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise TypeError(f"token ids must be an integer tensor, got {ids.dtype}")
        single = ids.dim() == 1
        ids = ids.reshape(1, -1) if single else ids
        rows = ids.tolist()
    else:
        ids = list(ids)
        single = not ids or not isinstance(ids[0], (list, tuple, torch.Tensor))
        rows = [ids] if single else [list(r.tolist() if isinstance(r, torch.Tensor) else r) for r in ids]
    if mask is not None:
        if isinstance(mask, torch.Tensor):
            mask = mask.reshape(len(rows), -1).tolist()
        elif single:
            mask = [list(mask)]
        if len(mask) != len(rows) or any(len(m) != len(r) for m, r in zip(mask, rows)):
            raise ValueError("attention_mask does not have the shape of input_ids")
        rows = [[t for t, keep in zip(r, m) if keep] for r, m in zip(rows, mask)]
    for r in rows:
        for t in r:
            if not isinstance(t, int) or isinstance(t, bool):
                raise TypeError(f"token ids must be ints, got {t!r} ({type(t).__name__})")
    return rows, single


def to_prompt(input, tokenizer) -> Prompt:
    """Normalise one invoke input to token rows (see module docstring)."""
    if isinstance(input, str):
        if tokenizer is None:
            raise ValueError("a string prompt needs a tokenizer: LanguageModel(model, tokenizer)")
        rows, single = [tokenizer(input)["input_ids"]], True
        what = [input]
    elif isinstance(input, Mapping):
        if "input_ids" not in input:
            raise ValueError(f"a mapping input needs 'input_ids' (a tokenizer output), got keys {sorted(input)}")
        rows, single = _ids_rows(input["input_ids"], input.get("attention_mask"))
        what = None
    elif isinstance(input, (list, tuple)) and input and all(isinstance(x, str) for x in input):
        if tokenizer is None:
            raise ValueError("string prompts need a tokenizer: LanguageModel(model, tokenizer)")
        rows, single = [tokenizer(x)["input_ids"] for x in input], False
        what = list(input)
    elif isinstance(input, (list, tuple, torch.Tensor)):
        if isinstance(input, (list, tuple)) and not input:
            raise ValueError("empty list of prompts: give at least one prompt (a string or token ids)")
        rows, single = _ids_rows(input)
        what = None
    else:
        raise TypeError(
            f"cannot use {type(input).__name__} as a language-model input: give a string, a list of strings, "
            "token ids (list of ints, list of lists, or a 1-D/2-D tensor) or a tokenizer output dict")
    for i, row in enumerate(rows):
        if len(row) == 0:
            name = f"prompt {_short(what[i])}" if what else f"row {i} of the token ids"
            raise ValueError(
                f"{name} has no tokens: a causal language model needs at least one token to predict from "
                "(prepend tokenizer.bos_token or some text)")
    return Prompt([list(r) for r in rows], single)


def context_length(config) -> int | None:
    """The model's maximum sequence length, if its config says."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_length(prompts, context: int | None, extra: int = 0) -> None:
    """Raise if a prompt (plus ``extra`` tokens to generate) exceeds the context."""
    if context is None:
        return
    longest = max(len(r) for p in prompts for r in p.rows)
    if longest + extra > context:
        more = f" + {extra} new tokens" if extra else ""
        raise ValueError(
            f"a prompt of {longest} tokens{more} exceeds the model's context of {context} positions; "
            "shorten the prompt" + (" or lower max_new_tokens" if extra else "") + " (e.g. keep its last "
            f"{max(1, context - extra)} tokens)")


def pad_id_of(tokenizer) -> int:
    """A token id for padded positions (never seen by the model: they are masked)."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None) if tokenizer is not None else None
        if isinstance(value, int):
            return value
    return 0


@dataclass
class Batch:
    """A left-padded batch and the layout that slices it per invoke."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    layout: Layout
    spans: list          # per invoke: (start, stop) rows, or None (whole batch)
    prompts: list        # per invoke: Prompt or None
    padded: bool         # whether any row has padding

    @property
    def position_ids(self) -> torch.Tensor:
        """Positions counting real tokens only, so a padded row sees 0, 1, ... like its solo run."""
        pos = self.attention_mask.long().cumsum(-1) - 1
        return pos.clamp(min=0)


def build_batch(inputs, tokenizer, device=None) -> Batch:
    """Tokenise every invoke input (``None``: no input) and left-pad them into one batch."""
    prompts = [None if x is None else to_prompt(x, tokenizer) for x in inputs]
    given = [p for p in prompts if p is not None]
    if not given:
        raise ValueError("no invoke has an input: give at least one invoke a prompt to run the model on")
    rows = [r for p in given for r in p.rows]
    width = max(len(r) for r in rows)
    pad = pad_id_of(tokenizer)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    spans, pads, start = [], [], 0
    for p in prompts:
        if p is None:
            spans.append(None)
            pads.append(0)
            continue
        n = len(p.rows)
        spans.append((start, start + n))
        pads.append(width - max(len(r) for r in p.rows))
        start += n
    padded = bool((mask == 0).any())
    if len(prompts) == 1:
        layout = Layout()
    elif any(pads):
        layout = PaddedLayout(spans, len(rows), pads, width)
    else:
        layout = BatchLayout(spans, len(rows))
    if device is not None:
        ids, mask = ids.to(device), mask.to(device)
    return Batch(ids, mask, layout, spans, prompts, padded)
