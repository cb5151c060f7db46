"""Tensor parallelism: tasks see full tensors where a rank only holds a shard; writes go back to the shards.

Under ``tensor_parallel_size=N`` every rank runs the whole model on its slice
of the weights. Most hook values are the same on every rank (layer outputs,
the outputs of row-parallel layers, which are all-reduced, the logits, which
are gathered). Some are not: a column-parallel layer's output holds this
rank's output features only, and the input of a row-parallel layer likewise.

For those points the hook all-gathers the shards before the tasks see the
value, so a task sees exactly the tensor the unsharded model (TP=1) has, with
the same feature order (merged layers such as ``qkv_proj`` = ``[q | k | v]``
and ``gate_up_proj`` = ``[gate | up]`` are reassembled part by part; key/value
heads replicated over ranks appear once). After the tasks ran, each rank
copies its own slice of the (possibly edited or replaced) full tensor back
into its shard. Every rank runs the same interventions (see
:mod:`.worker`), so the collective calls line up.

Sharded points handled here: the output of ``ColumnParallelLinear`` (and
``QKVParallelLinear`` / ``MergedColumnParallelLinear``), the input of
``RowParallelLinear``, the output of vLLM's ``Attention`` op and its
``(q, k, v)`` inputs, and both sides of ``SiluAndMul`` when it follows a
column-parallel layer. Anything else is shown per rank as it is (e.g.
``rotary_emb``'s per-rank ``q``/``k``).
"""

from __future__ import annotations

import torch


class Part:
    """One logical piece of a sharded last dimension: ``size`` features per rank, taken from ``ranks`` in order."""

    __slots__ = ("size", "ranks", "pos")

    def __init__(self, size: int, ranks, pos: int):
        self.size = int(size)       # features of this part on one rank
        self.ranks = list(ranks)    # the ranks whose copies make up the full part (replicas once)
        self.pos = int(pos)         # where this rank's copy sits in the full part


class Sharding:
    """How the tensors at ``paths`` of a hook value are split over the tensor-parallel ranks."""

    def __init__(self, paths: dict, rank: int, world: int):
        self.paths = paths          # path (tuple of indices into the value) -> [Part]
        self.rank = rank
        self.world = world

    # ----------------------------------------------------------------- access
    @staticmethod
    def get_at(value, path):
        """The item at ``path`` (a tuple of indices) inside nested ``value``."""
        for i in path:
            value = value[i]
        return value

    @staticmethod
    def set_at(value, path, new):
        """A copy of nested ``value`` with ``new`` at ``path`` (containers rebuilt, ``value`` untouched)."""
        if not path:
            return new
        head, rest = path[0], path[1:]
        if isinstance(value, tuple):
            items = list(value)
            items[head] = Sharding.set_at(items[head], rest, new)
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        if isinstance(value, list):
            items = list(value)
            items[head] = Sharding.set_at(items[head], rest, new)
            return items
        if isinstance(value, dict):
            out = dict(value)
            out[head] = Sharding.set_at(out[head], rest, new)
            return out
        raise TypeError(f"cannot address {path} in {type(value).__name__}")

    # ------------------------------------------------------------ gather/scatter
    def gather(self, value):
        """The value with every sharded tensor replaced by the full tensor (a collective call)."""
        from vllm.distributed import tensor_model_parallel_all_gather
        out = value
        for path, parts in self.paths.items():
            local = self.get_at(value, path)
            if not isinstance(local, torch.Tensor):
                continue
            every = tensor_model_parallel_all_gather(local.unsqueeze(0).contiguous(), dim=0)  # [world, ..., d]
            pieces, offset = [], 0
            for part in parts:
                for r in part.ranks:
                    pieces.append(every[r, ..., offset:offset + part.size])
                offset += part.size
            out = self.set_at(out, path, torch.cat(pieces, dim=-1))
        return out

    def local(self, full: torch.Tensor, parts) -> torch.Tensor:
        """This rank's shard of a full tensor."""
        pieces, offset = [], 0
        for part in parts:
            start = offset + part.pos * part.size
            pieces.append(full[..., start:start + part.size])
            offset += part.size * len(part.ranks)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)

    def scatter(self, final, original, replaced: bool):
        """Write this rank's slices of ``final`` (the full value the tasks left) into ``original``'s shards.

        The shards are updated in place. Returns what the hook should return:
        ``None`` when nothing was replaced (the module goes on with its own,
        updated, tensors), otherwise ``final`` with the local shards put back
        at the sharded paths.
        """
        for path, parts in self.paths.items():
            target = self.get_at(original, path)
            if not isinstance(target, torch.Tensor):
                continue
            full = self.get_at(final, path)
            target.copy_(self.local(full, parts).to(dtype=target.dtype))
        if not replaced:
            return None
        out = final
        for path in self.paths:
            target = self.get_at(original, path)
            if isinstance(target, torch.Tensor):
                out = self.set_at(out, path, target)
        return out


def _even(size, world, rank):
    return [Part(size, range(world), rank)]


def sharding_for(module, kind: str, parent=None):
    """The :class:`Sharding` of ``module``'s ``kind`` point (``"output"``/``"inputs"``), or ``None``."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
        world = get_tensor_model_parallel_world_size()
    except Exception:  # noqa: BLE001 - no distributed state: TP=1
        return None
    if world <= 1:
        return None
    rank = get_tensor_model_parallel_rank()
    from vllm.model_executor.layers import linear
    name = type(module).__name__

    if kind == "output" and isinstance(module, linear.ColumnParallelLinear) \
            and not getattr(module, "gather_output", False) and getattr(module, "tp_size", world) > 1:
        parts = []
        replicas = getattr(module, "num_kv_head_replicas", 1) if isinstance(module, linear.QKVParallelLinear) else 1
        for j, size in enumerate(module.output_partition_sizes):
            if j > 0 and replicas > 1:  # k and v heads replicated over `replicas` ranks: take each once
                parts.append(Part(size, range(0, world, replicas), rank // replicas))
            else:
                parts.append(Part(size, range(world), rank))
        return Sharding({(0,) if getattr(module, "return_bias", True) else (): parts}, rank, world)

    if kind == "inputs" and isinstance(module, linear.RowParallelLinear) \
            and getattr(module, "input_is_parallel", False) and getattr(module, "tp_size", world) > 1:
        return Sharding({(0, 0): _even(module.input_size_per_partition, world, rank)}, rank, world)

    if name == "Attention" and hasattr(module, "num_heads") and hasattr(module, "head_size"):
        hd = module.head_size
        hd_v = getattr(module, "head_size_v", hd)
        if kind == "output":
            return Sharding({(): _even(module.num_heads * hd_v, world, rank)}, rank, world)
        replicas = 1
        for sibling in (parent.children() if parent is not None else ()):
            if isinstance(sibling, linear.QKVParallelLinear):
                replicas = getattr(sibling, "num_kv_head_replicas", 1)
        kv = [Part(module.num_kv_heads * hd, range(0, world, replicas), rank // replicas)]
        kv_v = [Part(module.num_kv_heads * hd_v, range(0, world, replicas), rank // replicas)]
        return Sharding({(0, 0): _even(module.num_heads * hd, world, rank), (0, 1): kv, (0, 2): kv_v},
                        rank, world)

    if name.startswith("SiluAndMul") and parent is not None and any(
            isinstance(m, linear.MergedColumnParallelLinear) for m in parent.children()):
        up = next(m for m in parent.children() if isinstance(m, linear.MergedColumnParallelLinear))
        sizes = up.output_partition_sizes
        if kind == "output":
            return Sharding({(): _even(sizes[0], world, rank)}, rank, world)
        return Sharding({(0, 0): [Part(s, range(world), rank) for s in sizes]}, rank, world)
    return None
