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
into its shard. Gathering and re-sharding are the one mechanism of every
engine, :mod:`asyncinterp.hooks.sharded`; this module only says which vLLM
points are sharded and how (and gathers over vLLM's own group). Every rank runs the same interventions (see
:mod:`.worker`), so the collective calls line up.

Sharded points handled here: the output of ``ColumnParallelLinear`` (and
``QKVParallelLinear`` / ``MergedColumnParallelLinear``), the input of
``RowParallelLinear``, the output of vLLM's ``Attention`` op and its
``(q, k, v)`` inputs, and both sides of ``SiluAndMul`` when it follows a
column-parallel layer. Anything else is shown per rank as it is (e.g.
``rotary_emb``'s per-rank ``q``/``k``).
"""

from __future__ import annotations

from ...hooks.sharded import Part, Sharding, even

__all__ = ["Part", "Sharding", "sharding_for", "vllm_all_gather"]


def vllm_all_gather(t):
    """``[world, *t.shape]``: ``t`` from every tensor-parallel rank, over vLLM's own group."""
    from vllm.distributed import tensor_model_parallel_all_gather
    return tensor_model_parallel_all_gather(t.unsqueeze(0).contiguous(), dim=0)


def _sharding(paths, rank, world):
    return Sharding(paths, rank, world, vllm_all_gather)


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
        return _sharding({(0,) if getattr(module, "return_bias", True) else (): parts}, rank, world)

    if kind == "inputs" and isinstance(module, linear.RowParallelLinear) \
            and getattr(module, "input_is_parallel", False) and getattr(module, "tp_size", world) > 1:
        return _sharding({(0, 0): even(module.input_size_per_partition, world, rank)}, rank, world)

    if name == "Attention" and hasattr(module, "num_heads") and hasattr(module, "head_size"):
        hd = module.head_size
        hd_v = getattr(module, "head_size_v", hd)
        if kind == "output":
            return _sharding({(): even(module.num_heads * hd_v, world, rank)}, rank, world)
        replicas = 1
        for sibling in (parent.children() if parent is not None else ()):
            if isinstance(sibling, linear.QKVParallelLinear):
                replicas = getattr(sibling, "num_kv_head_replicas", 1)
        kv = [Part(module.num_kv_heads * hd, range(0, world, replicas), rank // replicas)]
        kv_v = [Part(module.num_kv_heads * hd_v, range(0, world, replicas), rank // replicas)]
        return _sharding({(0, 0): even(module.num_heads * hd, world, rank), (0, 1): kv, (0, 2): kv_v},
                        rank, world)

    if name.startswith("SiluAndMul") and parent is not None and any(
            isinstance(m, linear.MergedColumnParallelLinear) for m in parent.children()):
        up = next(m for m in parent.children() if isinstance(m, linear.MergedColumnParallelLinear))
        sizes = up.output_partition_sizes
        if kind == "output":
            return _sharding({(): even(sizes[0], world, rank)}, rank, world)
        return _sharding({(0, 0): [Part(s, range(world), rank) for s in sizes]}, rank, world)
    return None
