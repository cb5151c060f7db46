"""What the harvest loop hands to reductions: one batch of windows and their activations.

The one value that crosses from the engine side of a harvest to the
reductions (:mod:`.reductions`), so both sides agree on shapes and keys
without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["HarvestBatch"]


@dataclass(frozen=True)
class HarvestBatch:
    """``B`` windows of one harvest batch.

    * ``window_ids``: ``[B]`` int64, each window's index in the run (its place in the window order);
    * ``token_ids``: ``[B, T]`` int64, the windows' tokens;
    * ``acts``: point name (its TransformerLens name, or the user's path) -> ``[B, P, D]``
      activations at the ``P`` kept positions, in the dtype computed (fp32).
    """

    window_ids: torch.LongTensor
    token_ids: torch.LongTensor
    acts: dict[str, torch.Tensor]
