"""Which values a harvest records: points by name, the positions kept, and the storage dtype.

Why this module exists: a harvest names its points as researchers do, by any
path ``m.at`` resolves (``model.layers.6.output``, ``layers.6.resid_post``,
``layers.6.attn.z``, TransformerLens's ``blocks.6.hook_resid_post``), and
stores each under its TransformerLens name, the column name SAELens reads.
This module turns the user's names into column names, keeps the chosen
positions of each value (all, the last, or a slice) and flattens trailing
dimensions (``attn.z``: heads x head size) into one, as SAELens does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

__all__ = ["PointSpec", "parse_positions", "column_name", "STORAGE_DTYPES"]

#: storage dtypes: name -> (torch dtype, Arrow dtype of the column)
STORAGE_DTYPES = {"float32": (torch.float32, "float32"), "float16": (torch.float16, "float16"),
                  "bfloat16": (torch.bfloat16, "uint16")}
_DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
                  "float": "float32"}

_LAYER = r"(?:model\.)?(?:layers|blocks)\.(\d+)"
_TL = [
    (re.compile(_LAYER + r"\.(resid_pre|resid_mid|resid_post)$"), "blocks.{0}.hook_{1}"),
    (re.compile(_LAYER + r"\.(?:attn|self_attn)\.(q|k|v|z|pattern)$"), "blocks.{0}.attn.hook_{1}"),
    (re.compile(_LAYER + r"\.mlp\.(pre|post)$"), "blocks.{0}.mlp.hook_{1}"),
]


def storage_dtype(name) -> str:
    """The canonical storage dtype name of ``name`` (fp32 / bf16 / fp16 or a torch dtype)."""
    if isinstance(name, torch.dtype):
        name = str(name).replace("torch.", "")
    key = _DTYPE_ALIASES.get(str(name).lower(), str(name).lower())
    if key not in STORAGE_DTYPES:
        raise ValueError(f"storage dtype must be one of fp32, bf16, fp16 (or float32, bfloat16, float16), got {name!r}")
    return key


def column_name(path: str) -> str:
    """The column of a point: its TransformerLens name when it has one, else the path as given."""
    if path.startswith(("blocks.", "hook_", "ln_final")):
        return path
    for pattern, template in _TL:
        m = pattern.match(path)
        if m:
            return template.format(*m.groups())
    return path


def parse_positions(positions):
    """``"all"`` / ``None`` -> ``slice(None)``, ``"last"`` / ``-1`` -> ``-1``, ``"a:b"`` / a slice -> that slice."""
    if positions is None or positions == "all":
        return slice(None)
    if positions == "last" or positions == -1:
        return -1
    if isinstance(positions, slice):
        if positions.step not in (None, 1):
            raise ValueError(f"positions={positions!r}: a slice of positions takes no stride")
        return positions
    if isinstance(positions, (tuple, list)) and len(positions) == 2:
        return slice(*positions)
    if isinstance(positions, str) and positions.count(":") == 1:
        a, b = positions.split(":")
        try:
            return slice(int(a) if a.strip() else None, int(b) if b.strip() else None)
        except ValueError:
            pass
    raise ValueError(f"positions must be 'all', 'last', a slice or 'start:stop' (e.g. '1:' to drop BOS), "
                     f"got {positions!r}")


def kept(positions, context_size: int) -> int:
    """How many positions of a window ``positions`` keeps."""
    if positions == -1:
        return 1
    n = len(range(context_size)[positions])
    if n == 0:
        raise ValueError(f"positions={positions!r} keeps no position of a {context_size}-token window")
    return n


def describe_positions(positions) -> str:
    if positions == -1:
        return "last"
    return f"{'' if positions.start is None else positions.start}:{'' if positions.stop is None else positions.stop}"


@dataclass(frozen=True)
class PointSpec:
    """One harvested point: the path given, its column, and the shape of a window's stored value ``(P, D)``."""

    path: str
    column: str
    shape: tuple = ()

    def take(self, value: torch.Tensor, positions, batch: int, context: int) -> torch.Tensor:
        """The kept positions of a ``[B, T, ...]`` value as ``[B, P, D]`` (D: trailing dims flattened)."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"point {self.path!r} gives a {type(value).__name__}, not a tensor: harvest a point "
                            "whose value is one tensor (e.g. blocks.N.hook_resid_post, layers.N.output)")
        if value.dim() < 3 or value.shape[0] != batch or value.shape[1] != context:
            raise ValueError(f"point {self.path!r} gives shape {tuple(value.shape)}; a harvest stores values "
                             f"[batch={batch}, positions={context}, ...] (attention patterns and other "
                             "per-head layouts cannot be stored per position)")
        if positions == -1:
            value = value[:, -1:]
        else:
            value = value[:, positions]
        return value.reshape(value.shape[0], value.shape[1], -1)
