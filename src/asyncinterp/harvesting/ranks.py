"""A harvest on a tensor-parallel model: every rank computes, rank 0 alone reads and writes the directory.

Why this module exists: under ``torch.distributed`` (a transformers model
loaded with ``tp_plan="auto"``, started by ``asyncinterp.distributed.launch``)
the same script runs on every rank, every rank must run every forward (the
collectives need all of them), and each harvested point is gathered into the
full tensor on every rank. Only one rank may touch the output: rank 0 checks
the manifest and counts the completed shards, and the others receive its
answer (or its error, raised on every rank, so that no rank waits for a
collective the others never reach).
"""

from __future__ import annotations

__all__ = ["world", "on_rank0"]


def world() -> tuple:
    """``(rank, world size)`` of the current ``torch.distributed`` group, ``(0, 1)`` outside one."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def on_rank0(fn):
    """``fn()`` on rank 0, its result (or its exception) given to every rank."""
    rank, size = world()
    if size == 1:
        return fn()
    import torch.distributed as dist
    box = [None]
    if rank == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as exc:  # noqa: BLE001 - sent to every rank, raised there
            box[0] = ("error", exc)
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value
