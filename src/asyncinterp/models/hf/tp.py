"""A transformers model loaded with its tensor-parallel plan (``tp_plan="auto"``): interventions see full tensors.

``ai.LanguageModel(hf_model, tokenizer)`` becomes a :class:`ShardedLanguageModel`
when ``hf_model`` was sharded by transformers (``hf_model.tp_size > 1``).
Each rank runs the same script (``python -m asyncinterp.distributed.launch
--nproc 2 script.py``), the same interventions, on the same values; results
come back on every rank.

Which values are sharded is read from the model's own plan
(``hf_model.tp_plan``, styles from ``transformers.distributed``):

* the output of a ``colwise`` layer (``q_proj``, ``k_proj``, ``v_proj``,
  ``gate_proj``, ``up_proj``): this rank's output features;
* the input of a ``rowwise`` linear layer (``o_proj``, ``down_proj``);
* the activation module of an MLP whose projections are ``colwise``
  (``mlp.act_fn``: ``mlp.pre``), both sides;
* the attention weights an attention block returns (``[b, heads, n, n]``,
  eager attention), split by heads.

Everything else is replicated (the residual stream, layer outputs, the
all-reduced ``rowwise`` outputs, the gathered ``lm_head`` logits) and costs
nothing extra. A ``DTensor`` handed on by a style with ``use_local_output=False``
is gathered whole. The gathering itself is :mod:`asyncinterp.hooks.sharded`.
"""

from __future__ import annotations

import torch

from ...distributed.layers import TPRunMixin
from ...hooks.modules import submodules
from ...hooks.sharded import Sharding, even, torch_all_gather
from .language import LanguageModel
from .runs import GenerateRun, LMForwardEngine, LMGenerateEngine, LMRun

__all__ = ["ShardedLanguageModel", "is_tp_model", "hf_sharding"]

#: names of an MLP's activation module (as hooks.semantic finds ``mlp.pre``)
ACT_NAMES = ("act_fn", "act", "activation_fn", "activation", "act_func")


def is_tp_model(model) -> bool:
    """Whether ``model`` is a transformers model whose parameters its tensor-parallel plan sharded.

    A model loaded with ``tp_plan="auto"`` but without a plan for its
    architecture (GPT-2 in transformers 5.19) keeps whole parameters on every
    rank: it is not sharded, and a plain :class:`LanguageModel` runs it.
    """
    try:
        size = getattr(model, "tp_size", None)
    except Exception:  # noqa: BLE001 - not a transformers model
        return False
    if not isinstance(size, int) or size <= 1:
        return False
    try:
        _mesh_of(model)
    except RuntimeError:
        return False
    return True


def _mesh_of(model):
    from torch.distributed.tensor import DTensor
    for p in model.parameters():
        if isinstance(p, DTensor):
            return p.device_mesh
    raise RuntimeError("a tensor-parallel model without any DTensor parameter: was it loaded with tp_plan?")


def _style(plan, name):
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, replace_layer_number_by_wildcard
    style = plan.get(replace_layer_number_by_wildcard(name)) if name else None
    return ALL_PARALLEL_STYLES[style] if style in ALL_PARALLEL_STYLES else None


def _colwise_sharded(style) -> bool:
    from torch.distributed.tensor import Shard
    from transformers.distributed.tensor_parallel import ColwiseParallel
    return isinstance(style, ColwiseParallel) and isinstance(style.output_layouts, Shard) and style.use_local_output


def _rowwise_sharded(style, module) -> bool:
    from torch.distributed.tensor import Shard
    from transformers.distributed.tensor_parallel import RowwiseParallel
    return isinstance(style, RowwiseParallel) and isinstance(style.input_layouts, Shard) and \
        isinstance(module, torch.nn.Linear)


def hf_sharding(model, names: dict, module, kind: str, mesh):
    """The :class:`Sharding` of ``module``'s ``kind`` point under ``model``'s TP plan, or ``None`` (replicated)."""
    plan = model.tp_plan
    name = names.get(module)
    if name is None:
        return None
    world, rank = mesh.size(), mesh.get_local_rank()
    gather = torch_all_gather(mesh.get_group())
    style = _style(plan, name)

    def split(path, dim=-1):
        return Sharding({path: even(0, world, rank)}, rank, world, gather, {path: dim})

    if kind == "output" and _colwise_sharded(style):
        return split(())
    if kind == "inputs" and _rowwise_sharded(style, module):
        return split((0, 0))
    parent_name, _, last = name.rpartition(".")
    if last in ACT_NAMES and parent_name:
        parent = model.get_submodule(parent_name)
        if any(_colwise_sharded(_style(plan, f"{parent_name}.{n}")) for n in submodules(parent)):
            return split(() if kind == "output" else (0, 0))
    if kind == "output" and any(n in submodules(module) for n in ("q_proj", "k_proj")) and \
            _colwise_sharded(_style(plan, f"{name}.q_proj")):
        return split((1,), 1)          # (attn_output, attn_weights [b, heads, n, n]): the weights by heads
    return None


class _ShardedLMRun(TPRunMixin, LMRun):
    """One forward pass of a tensor-parallel language model (every rank)."""


class _ShardedGenerateRun(TPRunMixin, GenerateRun):
    """A generation of a tensor-parallel language model (every rank).

    Sampling without a ``seed`` would draw different tokens on each rank (and
    the ranks would then compute on different sequences): the ranks take
    rank 0's random seed instead (one broadcast at the start of the run).
    """

    def __init__(self, model, job):
        super().__init__(model, job)
        kw = self.generate_kwargs
        if kw.get("do_sample") and kw.get("seed") is None:
            import random

            import torch.distributed as dist
            mesh = model.tp_mesh
            seed = torch.tensor([random.getrandbits(31) if mesh.get_local_rank() == 0 else 0])
            dist.broadcast(seed, group=mesh.get_group(), group_src=0)
            kw["seed"] = int(seed.item())


class _ShardedForwardEngine(LMForwardEngine):
    def start(self, job):
        return _ShardedLMRun(self.model, job)


class _ShardedGenerateEngine(LMGenerateEngine):
    def start(self, job):
        return _ShardedGenerateRun(self.model, job)


class ShardedLanguageModel(LanguageModel):
    """A :class:`LanguageModel` over a transformers model sharded by its TP plan (see the module doc)."""

    def __init__(self, model, tokenizer=None, envoys: dict | None = None):
        super().__init__(model, tokenizer, envoys)
        init = object.__setattr__
        init(self, "_tp_names", {m: n for n, m in model.named_modules()})
        init(self, "_tp_mesh", _mesh_of(model))
        init(self, "_tp_shardings", {})

    @property
    def tp_size(self) -> int:
        return self._tp_mesh.size()

    @property
    def tp_mesh(self):
        """The device mesh the model's parameters are sharded over (its group does the gathers)."""
        return self._tp_mesh

    def sharding_of(self, module, kind: str):
        """The :class:`~asyncinterp.hooks.sharded.Sharding` of ``module``'s ``kind`` point, or ``None``."""
        cache = self._tp_shardings
        key = (module, kind)
        if key not in cache:
            cache[key] = hf_sharding(self.module, self._tp_names, module, kind, self._tp_mesh)
        return cache[key]

    def head_sharding(self) -> Sharding:
        """Attention heads split over the ranks (dim 1 of ``[b, heads, n, d]``: the KV cache, attention weights)."""
        mesh = self._tp_mesh
        return Sharding({(): even(0, mesh.size(), mesh.get_local_rank())}, mesh.get_local_rank(), mesh.size(),
                        torch_all_gather(mesh.get_group()), {(): 1})

    def engine(self, kind: str = "trace"):
        engines = self._engines
        if engines is None or engines["trace"].model is not self:
            engines = {"trace": _ShardedForwardEngine(self), "generate": _ShardedGenerateEngine(self)}
            object.__setattr__(self, "_engines", engines)
        try:
            return engines[kind]
        except KeyError:
            raise ValueError(f"a LanguageModel runs jobs of kind 'trace' or 'generate', not {kind!r}") from None


LanguageModel._variants.append((is_tp_model, ShardedLanguageModel))
