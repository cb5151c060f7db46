"""Tensor parallelism under ``torch.distributed``: one command to start the ranks, interventions unchanged.

::

    # python -m asyncinterp.distributed.launch --nproc 2 script.py
    import asyncinterp as ai
    from asyncinterp import distributed as tp

    tp.init()                                                     # gloo, with a collective timeout
    hf = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
    model = ai.LanguageModel(hf, tokenizer)                        # knows the plan: sharded points are gathered
    q = model.trace("Hello", lambda_free_fn)                       # same values as TP=1, on every rank

See docs/tensor-parallel.md. Pieces: :mod:`.group` (process group, timeout,
end-of-run agreement between ranks), :mod:`.launch` (the launcher),
:mod:`.layers` (column/row-parallel layers and ``wrap`` for models built from
them); the gathering itself is :mod:`asyncinterp.hooks.sharded`, shared with
vLLM.
"""

from ..hooks.sharded import Sharding, local_shard
from .group import RankFailedError, agree, init, rank, world_size
from .layers import ColumnParallelLinear, Elementwise, RowParallelLinear, ShardedModel, wrap

__all__ = ["ColumnParallelLinear", "Elementwise", "RankFailedError", "RowParallelLinear", "ShardedModel", "Sharding", "agree",
           "init", "local_shard", "rank", "world_size", "wrap"]
