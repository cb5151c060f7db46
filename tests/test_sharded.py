"""The sharded-view mechanism (``hooks/sharded.py``) in one process: gather order, write-back, nothing for reads.

Two ranks are simulated: the collective returns the shards both ranks hold of
a known full tensor, so gathering, each rank's slice and the write-back can be
checked exactly without a process group (tests/test_tp.py runs the real thing).
"""

import pytest
import torch

import asyncinterp as ai
from asyncinterp.hooks.sharded import Part, Sharding, even, local_shard


def shards_of(full_parts, world):
    """Per rank, the local tensor of a layout ``[(width per rank, replicas)]`` cut from ``full_parts``."""
    local = []
    for r in range(world):
        pieces = []
        for t, replicas in full_parts:
            n = t.shape[-1] // (world // replicas)
            pos = r // replicas
            pieces.append(t[..., pos * n:(pos + 1) * n])
        local.append(torch.cat(pieces, -1))
    return local


def fake_gather(locals_):
    return lambda t: torch.stack(locals_)


def test_merged_parts_with_replicated_heads_gather_in_unsharded_order():
    q, k, v = torch.randn(3, 8), torch.randn(3, 2), torch.randn(3, 2)    # k, v: one head replicated on 2 ranks
    local = shards_of([(q, 1), (k, 2), (v, 2)], world=2)
    parts = [Part(4, range(2), 0), Part(2, range(0, 2, 2), 0), Part(2, range(0, 2, 2), 0)]
    shard = Sharding({(): parts}, 0, 2, fake_gather(local))
    full, token = shard.gather(local[0])
    assert torch.equal(full, torch.cat([q, k, v], -1))
    assert torch.equal(shard.local(full, ()), local[0])
    assert shard.scatter(full, token, None, local[0]) is None          # read only: nothing written back


def test_in_place_edit_and_replacement_come_back_as_this_ranks_slice():
    full_t = torch.randn(2, 5, 8)
    local = shards_of([(full_t, 1)], world=2)
    for rank in (0, 1):
        shard = Sharding({(0,): even(0, 2, rank)}, rank, 2, fake_gather(local))
        out = (local[rank].clone(), "bias")
        full, token = shard.gather(out)
        assert torch.equal(full[0], full_t) and full[1] == "bias"
        full[0][..., 1] = 0.0                                            # an in-place edit of the gathered tensor
        new = shard.scatter(full, token, None, out)
        want = full_t.clone()
        want[..., 1] = 0.0
        assert torch.equal(new[0], want[..., rank * 4:(rank + 1) * 4]) and new[1] == "bias"
        replaced = (full_t * 2, "bias")
        new = shard.scatter(full, token, replaced, out)
        assert torch.equal(new[0], (full_t * 2)[..., rank * 4:(rank + 1) * 4])


def test_inference_tensors_are_updated_in_place():
    with torch.inference_mode():
        full_t = torch.randn(3, 4)
        local = [t.clone() for t in shards_of([(full_t, 1)], world=2)]
        shard = Sharding({(): even(2, 2, 1)}, 1, 2, fake_gather(local))
        full, token = shard.gather(local[1])
        full.mul_(3.0)
        assert shard.scatter(full, token, None, local[1]) is None        # the module goes on with its own tensor
        assert torch.allclose(local[1], full_t[:, 2:] * 3.0)


def test_heads_split_on_another_dimension():
    pattern = torch.randn(1, 4, 5, 5)                                   # [b, heads, n, n]: heads on dim 1
    local = [pattern[:, :2], pattern[:, 2:]]
    shard = Sharding({(1,): even(0, 2, 1)}, 1, 2, fake_gather(local), {(1,): 1})
    full, _ = shard.gather(("out", local[1]))
    assert torch.equal(full[1], pattern) and shard.local(full[1], (1,)).shape == (1, 2, 5, 5)


def test_local_shard_of_an_unsharded_model_is_the_value_and_refuses_derived_points():
    torch.manual_seed(0)
    model = ai.wrap(torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU()))
    x = torch.randn(2, 4)

    async def both(m):
        full = (await m[0].output).clone()
        return full, (await local_shard(m[1].input)).clone()
    full, mine = model.trace(x, both)
    assert torch.equal(torch.relu(full), torch.relu(mine)) and mine.shape == (2, 6)
    with pytest.raises(TypeError, match="local_shard takes a module's .output"):
        local_shard(model[0].output.grad)
