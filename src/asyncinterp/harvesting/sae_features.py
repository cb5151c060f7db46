"""An SAE's features of harvested activations, read at the SAE's own hook point (for top-k per feature).

Why this module exists: "which windows make SAE feature f fire" is the
question feature dashboards ask. The feature activation is what docs/attach.md
reads when the SAE is spliced into the model: the output of the SAE's feature
point (``hook_sae_acts_post`` in SAELens's layout), on the activations of the
point the SAE reads. Splicing changes only what comes after the point, so
the features of a window are the SAE run on that point's value; this module
runs the SAE, wrapped (``ai.wrap``), on each window's ``[P, D]`` activations,
awaits the feature point and stops the SAE there (its decoder never runs).
It works wherever the reduction runs: the transformers loop, inside a vLLM
engine, on a Ray actor.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["SAEFeatures"]


class SAEFeatures:
    """``features(acts [P, D]) -> [P, F]``: the output of ``sae``'s submodule ``feature`` on ``acts``."""

    def __init__(self, sae: torch.nn.Module, feature: str = "hook_sae_acts_post"):
        if not isinstance(sae, torch.nn.Module):
            raise TypeError(f"sae must be an nn.Module (an SAELens SAE, or any module with a feature point), "
                            f"got {type(sae).__name__}")
        try:
            sae.get_submodule(feature)
        except AttributeError:
            names = [n for n, _ in sae.named_modules() if n]
            raise ValueError(f"the SAE has no submodule {feature!r} to read features at; its submodules: "
                             f"{names[:20]}") from None
        self.sae = sae
        self.feature = feature
        self._wrapped = None
        self._digest = None

    @property
    def digest(self) -> str:
        """A hash of the SAE's weights and the feature point (what the harvest's manifest records)."""
        if self._digest is None:
            h = hashlib.sha256(self.feature.encode())
            for name, t in sorted(self.sae.state_dict().items()):
                t = t.detach().cpu().contiguous()
                h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            self._digest = h.hexdigest()
        return self._digest

    def __call__(self, acts: torch.Tensor) -> torch.Tensor:
        from ..model import wrap
        if self._wrapped is None:
            self._wrapped = wrap(self.sae)
        path = f"{self.feature}.output"

        async def read(m):
            value = (await m.at(path)).to(torch.float32, copy=True)
            m.stop()                       # the features are all we need: the decoder does not run
            return value

        dtype = next((p.dtype for p in self.sae.parameters()), torch.float32)
        with torch.no_grad():
            return self._wrapped.trace(acts.to(dtype), read)

    def __reduce__(self):                   # the wrapper holds locks; it is made again where it is used
        return (SAEFeatures, (self.sae, self.feature))

    def __deepcopy__(self, memo):           # immutable: copies of a reduction share the SAE
        return self
