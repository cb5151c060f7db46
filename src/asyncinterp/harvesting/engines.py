"""The engines a harvest runs windows through: transformers forwards, and vLLM's own scheduler.

Why this module exists: the harvest loop hands an engine a batch of windows
(``[B, T]`` token ids) and gets back, per point, the values at the kept
positions as ``float32 [B, P, D]``. Each engine reads the points with the
library's own run machinery (an intervention over ``m.at(path)``), so every
name ``m.at`` knows works on every engine, semantic points and
TransformerLens names included:

* :class:`TransformersEngine`: one batched forward per batch (no generation,
  no padding: windows have one length), each point copied where it fires,
  and the forward stopped after the last point (the layers after it and the
  unembedding are not computed; ``stop_early=False`` runs them);
* :class:`VLLMEngine`: one request per window (``max_tokens=1``), all of a
  batch submitted at once so vLLM's scheduler batches them at full width;
  each point is recorded as it fires, chunk by chunk when vLLM splits a
  prompt across engine steps, and the chunks are joined in order.
"""

from __future__ import annotations

import torch

from ..kernel.tasks import gather
from .vllm_capture import join_chunks, recorder

__all__ = ["TransformersEngine", "VLLMEngine", "engine_for"]


class TransformersEngine:
    """Batched forwards of an ``ai.LanguageModel`` (or any wrapped model taking ``[B, T]`` ids)."""

    kind = "transformers"

    def __init__(self, model, specs, positions, stop_early: bool = True):
        self.model = model
        self.specs = specs
        self.positions = positions
        self.stop_early = stop_early

    def __call__(self, ids: torch.Tensor) -> dict:
        specs, positions = self.specs, self.positions
        batch, context = ids.shape

        async def grab(m, spec):
            value = await m.at(spec.path)
            return spec.take(value, positions, batch, context).to(torch.float32, copy=True)

        async def harvest(m):
            values = await gather(*(grab(m, s) for s in specs))
            if self.stop_early:
                m.stop()
            return values

        with torch.no_grad():
            values = self.model.trace(ids, harvest)
        return {s.column: v for s, v in zip(specs, values)}


class VLLMEngine:
    """Prompt-only requests (``max_tokens=1``) through an ``ai.VLLM`` engine's scheduler."""

    kind = "vllm"

    def __init__(self, model, specs, positions):
        self.model = model
        self.specs = specs
        self.positions = positions

    def __call__(self, ids: torch.Tensor) -> dict:
        batch, context = ids.shape
        per_window = [[[] for _ in self.specs] for _ in range(batch)]
        with self.model.generate(max_new_tokens=1, temperature=0.0) as run:
            for row, chunks in zip(ids, per_window):
                run.invoke(row, recorder(self.specs, chunks))
        out = {}
        for i, spec in enumerate(self.specs):
            rows = [join_chunks(spec, per_window[w][i], self.positions, context, w) for w in range(batch)]
            out[spec.column] = torch.cat(rows, dim=0)
        return out

    def reduce(self, ids: torch.Tensor, window_ids: torch.Tensor, reductions) -> list:
        """The reductions of a batch, computed inside the engine (see :mod:`.in_engine`): one state per
        window comes back, not the activations. ``reductions`` hold no state yet; returns copies of them
        holding the batch's."""
        from .in_engine import merged, window_reducer
        batch, context = ids.shape
        with self.model.generate(max_new_tokens=1, temperature=0.0) as run:
            invokes = [run.invoke(row, window_reducer(self.specs, self.positions, context, int(w), row, reductions))
                       for row, w in zip(ids, window_ids)]
        return merged(reductions, [inv.result for inv in invokes])


def engine_for(model, specs, positions, reduce_only: bool = False, **options):
    """The harvest engine of ``model``: vLLM for ``ai.VLLM``, transformers forwards otherwise.

    ``reduce_only``: the harvest keeps only reductions, which a vLLM engine computes inside its
    interventions (:mod:`.in_engine`), under tensor parallelism too."""
    if type(model).__name__ == "VLLM":
        if getattr(model, "tp", 1) > 1 and not reduce_only:
            raise NotImplementedError(
                "ai.harvest on a vLLM engine with tensor_parallel_size > 1 is not supported yet: its interventions "
                "run in vLLM's worker processes, and the harvest records in this one. Harvest on vLLM with "
                "tensor_parallel_size=1, or on a transformers model loaded with tp_plan='auto' (docs/harvest.md); "
                "reductions alone (save_activations=False) do run under vLLM tensor parallelism")
        return VLLMEngine(model, specs, positions)
    return TransformersEngine(model, specs, positions, **options)
