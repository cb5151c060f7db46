"""What a harvest hands each reduction for every batch of windows: the contract between the loop and reductions.

Why this module exists: reductions (running statistics, top-k windows,
histograms, difference of means; see the reductions module) are computed where
the activations are, batch by batch, without knowing which engine produced
them. They see only this value::

    HarvestBatch(window_ids=[B], token_ids=[B, T], acts={name: [B, P, D]})

``window_ids`` number the windows of the run from 0 in dataset order;
``token_ids`` are the full windows (``T`` = ``context_size``); ``acts`` maps
each point's column name (its TransformerLens name, ``blocks.6.hook_resid_post``,
or the path the user gave when it has none) to the activations at the kept
positions (``P``: all, the last, or a slice), trailing dimensions flattened
into ``D`` as the columns store them, in float32 as computed (before the
storage dtype cast).

A reduction is any object with::

    update(batch: HarvestBatch) -> None          # every batch, in window order
    state_dict() -> dict[str, torch.Tensor]     # saved (safetensors) beside each completed shard
    load_state_dict(d) -> None                  # restored from the last completed shard on resume
    merge(other) -> None                        # combine with the same reduction over other windows
    result()                                    # the final value, written when the harvest ends
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

__all__ = ["HarvestBatch", "Reduction"]


@dataclass(frozen=True)
class HarvestBatch:
    """One batch of windows and the activations of every harvested point (see the module docs)."""

    window_ids: torch.Tensor          # int64 [B]
    token_ids: torch.Tensor           # int64 [B, T]
    acts: dict                        # name -> float32 [B, P, D]


@runtime_checkable
class Reduction(Protocol):
    """What ``ai.harvest(..., reductions=[...])`` calls on each reduction (see the module docs)."""

    def update(self, batch: HarvestBatch) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, d: dict) -> None: ...

    def merge(self, other) -> None: ...

    def result(self): ...
