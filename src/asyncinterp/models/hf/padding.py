"""The padding-aware layout of a left-padded language-model batch.

Prompts of different lengths share one forward pass by left padding: every row
ends at the same column and the shorter rows start with pad tokens that the
attention mask hides. An invoke should see what its prompt would produce in a
run of its own, so its view of a hook value is its rows *and*, along the
sequence dimension, only its real tokens: ``h[:, -1]`` is its last token and
``h.shape[1]`` is its prompt length, exactly as in a solo run.

Which dimension is "the sequence" is decided from shapes, per tensor:

* 2-D and 3-D tensors ``[batch, seq, ...]`` (hidden states, logits, token ids,
  2-D masks) are cut along dim 1 when it has the length of this pass's queries
  (``seq_len``) or of all keys so far (``key_len``, which grows during
  generation);
* 4-D tensors ``[batch, heads, queries, keys]`` (attention weights, 4-D masks)
  are cut along dims 2 and 3 when both lengths match;
* anything else (unbatched tensors, per-head reshapes, caches) is cut along
  the batch only.

Each invoke strips the padding that all its rows share (the smallest pad among
them), so an invoke of several prompts sees them padded against each other as
in its own solo run. The cut is plain slicing, so views stay views: in-place
edits reach the model, and replacements are written back into the same slots.
"""

from __future__ import annotations

import torch

from ...hooks.views import BatchLayout, map_tensors


class PaddedLayout(BatchLayout):
    """Invokes own rows of dim 0 and, inside them, their real (unpadded) positions."""

    def __init__(self, spans, batch_size: int, pads, seq_len: int):
        super().__init__(spans, batch_size)
        self.pads = [int(p) for p in pads]
        self.seq_len = int(seq_len)
        self.key_len = int(seq_len)

    def set_step(self, seq_len: int, key_len: int) -> None:
        """A new pass: ``seq_len`` new positions, ``key_len`` positions in total (past + new)."""
        self.seq_len = int(seq_len)
        self.key_len = int(key_len)

    def view(self, value, group):
        # every tensor goes through `index` (the base class may take a rows-only fast path)
        if self.spans[group] is None:
            return value

        def cut(t):
            idx = self.index(t, group)
            return t if idx is None else t[idx]
        if type(value) is torch.Tensor:
            return cut(value)
        return map_tensors(cut, value)

    def index(self, tensor, group):
        span = super().index(tensor, group)
        if span is None:
            return None
        pad = self.pads[group]
        nd = tensor.dim()
        if not pad or nd < 2 or nd > 4:
            return span
        queries, keys = self.seq_len, self.key_len
        # the pass's queries start `keys - queries` positions into the sequence
        q0 = max(0, pad - (keys - queries))
        shape = tensor.shape
        if nd == 4:
            if shape[2] == queries and shape[3] == keys:
                return (span, slice(None), slice(q0, None), slice(pad, None))
            return span
        if shape[1] == queries:
            return (span, slice(q0, None)) if q0 else span
        if shape[1] == keys:
            return (span, slice(pad, None))
        return span

    def __repr__(self):
        return (f"PaddedLayout(spans={self.spans}, pads={self.pads}, seq_len={self.seq_len}, "
                f"key_len={self.key_len})")
