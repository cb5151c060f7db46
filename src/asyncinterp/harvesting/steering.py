"""A steering vector from a harvest, in the forms that apply it: ``--edit``, the edit registry, ``model.edit``.

Why this module exists: a difference of means (:func:`.reductions.difference_of_means`)
is only useful once it steers a model. The server's built-in ``steer``
intervention adds ``strength * vector`` to a module's output; a saved
:class:`SteeringVector` is exactly its parameters as a JSON object, so

    asyncinterp serve MODEL --edit up=steer:@steer.json

(or ``server.add_edit("up", intervention="steer", params=sv.params(model))``)
installs it, and ``model.edit(sv.edit())`` applies it in process.
"""

from __future__ import annotations

import json
import os

import torch

__all__ = ["SteeringVector"]


class SteeringVector:
    """``vector`` (``[D]``, float32) to add at ``point`` (a TransformerLens name or a path, as harvested)."""

    def __init__(self, point: str, vector: torch.Tensor):
        vector = torch.as_tensor(vector)
        if vector.dim() != 1 or not vector.is_floating_point():
            raise ValueError(f"a steering vector is a float [D] tensor, got {tuple(vector.shape)} {vector.dtype}")
        self.point = point
        self.vector = vector.detach().to(torch.float32)

    def module_path(self, model) -> str:
        """The module of ``model`` whose output (first tensor) is ``point``: what ``steer``'s ``module`` names.

        ``resid_post`` (``blocks.L.hook_resid_post``) is layer ``L``'s output;
        a module's ``.output`` is that module's. Other points (``resid_pre``,
        ``attn.z``, ...) are not a module's output, so the built-in ``steer``
        cannot add to them: that is an error, not a vector added elsewhere.
        """
        found = model.at(self.point)
        name = getattr(found, "name", None)
        envoy = getattr(found, "envoy", None)
        if envoy is None or name not in ("output", "resid_post"):
            raise ValueError(f"the steering point {self.point!r} ({found!r}) is not a module's output; the server's "
                             "steer intervention adds to a module's output, so steer at a resid_post or .output "
                             "point (or apply this vector with model.edit(sv.edit()), which adds at any point)")
        return envoy.path

    def params(self, model, strength: float = 1.0) -> dict:
        """The built-in ``steer`` intervention's parameters (``module``, ``vector``, ``strength``)."""
        return {"module": self.module_path(model), "vector": self.vector.tolist(), "strength": float(strength)}

    def save(self, path: str, model, strength: float = 1.0) -> str:
        """Write :meth:`params` as a JSON object to ``path`` (``--edit NAME=steer:@PATH`` reads it); returns ``path``.

        The floats are written in full (float32 values survive the round trip exactly).
        """
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(self.params(model, strength), fh)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str, point: str | None = None) -> "SteeringVector":
        """A vector saved by :meth:`save` (``point``: its point; default the module's output)."""
        with open(path) as fh:
            params = json.load(fh)
        if not isinstance(params, dict) or "vector" not in params or "module" not in params:
            raise ValueError(f"{path} is not a saved steering vector (a JSON object with 'module' and 'vector')")
        return cls(point or f"{params['module']}.output", torch.tensor(params["vector"], dtype=torch.float32))

    def edit(self, strength: float = 1.0):
        """An ``async def fn(m)`` that adds ``strength * vector`` at ``point`` on every pass (for ``model.edit``)."""
        point, delta = self.point, strength * self.vector

        async def steer_edit(m):
            h = await m.at(point)
            if h.shape[-1] != delta.shape[0]:
                raise ValueError(f"steering vector of width {delta.shape[0]}, but {point} has width {h.shape[-1]}")
            h += delta.to(h.dtype)

        steer_edit.__qualname__ = f"steer at {point}"
        return steer_edit

    def __repr__(self):
        return f"SteeringVector({self.point!r}, width={self.vector.shape[0]}, norm={float(self.vector.norm()):.4g})"
