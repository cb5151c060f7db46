"""Column- and row-parallel linear layers over ``torch.distributed``, and a model wrapper that knows them.

The smallest tensor-parallel model one can build by hand: a column-parallel
layer keeps ``out_features / world`` output rows of the weight and returns its
slice of the output features; a row-parallel layer keeps ``in_features /
world`` input columns, takes the matching slice of its input, and all-reduces
its partial products (the bias added once). ``from_linear`` cuts an existing
``nn.Linear`` so that the same weights run at TP=1 and TP=N.

Each layer declares which of its values are sharded (``tp_shard_output`` /
``tp_shard_input``: the split dimension) and over which group
(``tp_group``); :class:`ShardedModel` (``ai.distributed.wrap``) reads those
declarations, so awaiting such a layer's output gives the full tensor (see
:mod:`asyncinterp.hooks.sharded`). Any module can declare the same
attributes. Gradients do not flow through the row-parallel all-reduce: these
layers are for inference and interventions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..engine import ForwardEngine
from ..hooks.sharded import Sharding, ShardedHooks, even, torch_all_gather
from ..model import Model
from ..run import Run
from .group import agree

__all__ = ["ColumnParallelLinear", "Elementwise", "RowParallelLinear", "ShardedModel", "TPRunMixin", "wrap", "declared_sharding"]


def _rank_world(group):
    return dist.get_rank(group), dist.get_world_size(group)


class ColumnParallelLinear(nn.Module):
    """``y[..., this rank's output features] = x W_r^T + b_r``: the output is sharded on its last dimension."""

    tp_shard_output = -1

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None):
        super().__init__()
        rank, world = _rank_world(group)
        if out_features % world:
            raise ValueError(f"out_features={out_features} must be divisible by the {world} ranks")
        self.tp_group = group
        self.in_features, self.out_features = in_features, out_features // world
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(self.out_features)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None) -> "ColumnParallelLinear":
        rank, world = _rank_world(group)
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group)
        n = layer.out_features
        with torch.no_grad():
            layer.weight.copy_(linear.weight[rank * n:(rank + 1) * n])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias[rank * n:(rank + 1) * n])
        return layer

    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_r W_r^T) + b``: the input is sharded on its last dimension, the output replicated."""

    tp_shard_input = -1

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None):
        super().__init__()
        rank, world = _rank_world(group)
        if in_features % world:
            raise ValueError(f"in_features={in_features} must be divisible by the {world} ranks")
        self.tp_group = group
        self.in_features, self.out_features = in_features // world, out_features
        self.weight = nn.Parameter(torch.empty(out_features, self.in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None) -> "RowParallelLinear":
        rank, world = _rank_world(group)
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group)
        n = layer.in_features
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, rank * n:(rank + 1) * n])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x):
        y = nn.functional.linear(x, self.weight)
        dist.all_reduce(y, group=self.tp_group)
        return y if self.bias is None else y + self.bias


class Elementwise(nn.Module):
    """An elementwise module (activation, dropout) between a column- and a row-parallel layer: both sides sharded.

    ``Elementwise(nn.GELU())`` runs the module as it is and declares that its
    input and output are sharded on the last dimension, so they are gathered
    when awaited like the layers' own values.
    """

    tp_shard_output = -1
    tp_shard_input = -1

    def __init__(self, module: nn.Module, group=None):
        super().__init__()
        self.module = module
        self.tp_group = group

    def forward(self, x):
        return self.module(x)


def declared_sharding(module, kind: str):
    """The :class:`Sharding` a module declares for its ``kind`` point (``tp_shard_output``/``tp_shard_input``)."""
    dim = getattr(module, "tp_shard_output" if kind == "output" else "tp_shard_input", None)
    if dim is None:
        return None
    group = getattr(module, "tp_group", None)
    rank, world = _rank_world(group)
    if world == 1:
        return None
    path = () if kind == "output" else (0, 0)
    return Sharding({path: even(0, world, rank)}, rank, world, torch_all_gather(group), {path: dim})


class TPRunMixin(ShardedHooks):
    """A run of a tensor-parallel model: sharded hooks, and the ranks agree on how each run ended."""

    def wait(self, cancellable: bool = False, around=None) -> None:
        try:
            super().wait(cancellable, around)
        except Exception as exc:   # noqa: BLE001 - reported to the other ranks, then raised (see group.agree)
            agree(exc)
            raise
        agree(None)


class _ShardedRun(TPRunMixin, Run):
    """The forward of a :class:`ShardedModel`."""


class _ShardedEngine(ForwardEngine):
    def start(self, job):
        return _ShardedRun(self.model, job)


class ShardedModel(Model):
    """``ai.wrap`` for a module built from tensor-parallel layers: sharded values are gathered for tasks.

    Run the same script on every rank (``python -m asyncinterp.distributed.launch``);
    every rank runs the interventions on the same full values, so they make
    the same edits. Results are returned on every rank.
    """

    def __init__(self, module, **kwargs):
        Model.__init__(self, module, **kwargs)
        object.__setattr__(self, "_tp_shardings", {})
        object.__setattr__(self, "_tp_engine", None)

    def sharding_of(self, module, kind: str):
        """The :class:`Sharding` of ``module``'s ``kind`` point (declared by the layer), or ``None``."""
        cache = self._tp_shardings
        key = (id(module), kind)
        if key not in cache:
            cache[key] = declared_sharding(module, kind)
        return cache[key]

    def engine(self, kind: str = "trace"):
        if kind != "trace":
            return Model.engine(self, kind)
        engine = self._tp_engine
        if engine is None or engine.model is not self:
            engine = _ShardedEngine(self)
            object.__setattr__(self, "_tp_engine", engine)
        return engine


def wrap(module, **kwargs) -> ShardedModel:
    """Wrap a module built from tensor-parallel layers (see :class:`ShardedModel`)."""
    return ShardedModel(module, **kwargs)
