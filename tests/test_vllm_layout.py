"""Pieces of the vLLM support that need no engine: the flat-token layout and partial kernel steps.

These run without vLLM installed (nothing here imports it).
"""

from dataclasses import dataclass

import pytest
import torch

from asyncinterp.kernel.errors import MissedHookPoint
from asyncinterp.kernel.scheduler import Kernel
from asyncinterp.kernel.traps import StepTrap, trap
from asyncinterp.models.vllm.layout import FlatLayout
from kernelfakes import FakeHost, P

pytestmark = pytest.mark.vllm


# ----------------------------------------------------------------------------- FlatLayout


def _layout(per_request=False):
    lay = FlatLayout(per_request=per_request)
    # requests of invokes 2, 0, 1 back to back (runner order != invoke order); invoke 3 has no request
    lay.set_step({2: (0, 3, 0), 0: (3, 4, 1), 1: (4, 9, 2)}, tokens=9, rows=3)
    return lay


def test_views_are_live_rows_with_a_batch_dim():
    lay = _layout()
    h = torch.arange(9 * 4, dtype=torch.float32).reshape(9, 4)
    v = lay.view(h, 1)
    assert v.shape == (1, 5, 4) and torch.equal(v[0], h[4:9])
    v[:, -1] = -1.0                               # in place reaches the full tensor, only those rows
    assert torch.equal(h[8], torch.full((4,), -1.0)) and h[3, 0] == 12
    assert lay.view(h, 3) is h                    # no request: the whole flat batch
    out = lay.view((h, None, torch.zeros(5)), 0)  # tuples; unbatched tensors whole
    assert out[0].shape == (1, 1, 4) and out[1] is None and out[2].shape == (5,)


def test_request_mode_gives_one_row_per_request():
    lay = _layout().request_mode()
    logits = torch.randn(3, 7)
    assert torch.equal(lay.view(logits, 1), logits[2:3])
    assert torch.equal(lay.view(logits, 2), logits[0:1])


def test_merge_writes_each_invoke_rows_only():
    lay = _layout()
    h = torch.zeros(9, 2)
    new = lay.merge(h, {1: torch.ones(1, 5, 2), 2: torch.full((1, 3, 2), 2.0)})
    assert torch.equal(new[:3], torch.full((3, 2), 2.0)) and torch.equal(new[3], torch.zeros(2))
    assert torch.equal(new[4:], torch.ones(5, 2)) and torch.equal(h, torch.zeros(9, 2))
    whole = lay.merge(h, {3: torch.full((9, 2), 5.0), 0: torch.full((1, 1, 2), 7.0)})
    assert whole[3, 0] == 7.0 and whole[0, 0] == 5.0


@dataclass
class _Out:
    sampled_token_ids: torch.Tensor
    logprobs_tensors: object = None


def test_dataclasses_are_sliced_and_rebuilt():
    lay = _layout().request_mode()
    out = _Out(torch.tensor([[5], [6], [7]]))
    v = lay.view(out, 0)
    assert isinstance(v, _Out) and v.sampled_token_ids.tolist() == [[6]]
    merged = lay.merge(out, {0: _Out(torch.tensor([[42]]))})
    assert merged.sampled_token_ids.tolist() == [[5], [42], [7]]


def test_covers_all():
    lay = FlatLayout()
    lay.set_step({0: (0, 4, 0)}, tokens=4, rows=1)
    assert lay.covers_all(5)            # an invoke without a request sees the flat value as it is
    assert not lay.covers_all(0)        # a lone request's view is [1, n, ...] of the flat [n, ...]: never whole
    assert lay.request_mode().covers_all(0)   # one row per request: the view is the value
    assert not _layout().covers_all(1)


# ----------------------------------------------------------------------------- partial kernel steps


def Host():
    return FakeHost(order=())


def test_invokes_sitting_a_step_out_keep_waiting():
    k = Kernel(Host())
    log = []

    async def task(name):
        step = 0
        while True:
            v = await P("layer")
            log.append((name, step, v))
            s = await trap(StepTrap())
            if s is None:
                log.append((name, "end"))
                return
            step = s

    k.spawn(task("a"), 0)
    k.spawn(task("b"), 1)
    k.drain()
    k.active = frozenset({0})                    # step 0: only invoke 0 is scheduled
    k.provide("layer", lambda t, tr: "v0")
    assert log == [("a", 0, "v0")]
    k.begin_step(None)                           # step 1: both; b's wait carried over (no miss)
    k.provide("layer", lambda t, tr: "v1")
    assert log[1:] == [("a", 1, "v1"), ("b", 0, "v1")]
    k.begin_step(frozenset({1}))                 # step 2: only b; a's step loop does not advance
    k.provide("layer", lambda t, tr: "v2")
    assert log[3:] == [("b", 2, "v2")]
    k.begin_step(None)                           # step 3: a resumes its loop
    k.provide("layer", lambda t, tr: "v3")
    assert log[4:] == [("a", 3, "v3"), ("b", 3, "v3")]
    k.finish()
    assert log[6:] == [("a", "end"), ("b", "end")] and not k.failures


def test_a_wait_of_an_active_invoke_is_still_missed_at_step_end():
    k = Kernel(Host())

    async def wait_late():
        try:
            await P("never")
        except MissedHookPoint:
            return "missed"

    t1 = k.spawn(wait_late(), 0)
    t2 = k.spawn(wait_late(), 1)
    k.drain()
    k.active = frozenset({0})
    k.begin_step(frozenset({0, 1}))              # invoke 0 was in step 0: its wait ended with it
    assert t1.done and t1.result == "missed"
    assert not t2.done                           # invoke 1 sat step 0 out: still waiting
    k.finish()
    assert t2.result == "missed"
