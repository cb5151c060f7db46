"""MoE points under tensor parallelism 2 (vLLM on CPU, workers in subprocesses) against transformers.

Each rank holds half of every expert (FusedMoE's default TP layout); the
interventions run identically on both ranks. ``router`` is the replicated
gate's output, ``routed`` and ``per_expert`` are the experts' outputs after
vLLM's all-reduce inside the layer. One engine, one test (start-up is slow).
"""

import pytest
import torch

import asyncinterp as ai
from vllm_helpers import ENGINE, hf_model, require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = "The quick brown fox jumps"


async def read(m):
    block = m.layers[1].mlp
    r = (await block.router).clone()
    e = (await block.per_expert).clone()
    o = (await block.routed).clone()
    return r, e, o, (await m.logits).clone()


async def mask_top(m):
    r = await m.layers[0].mlp.router
    r.scatter_(-1, r.argmax(-1, keepdim=True), float("-inf"))
    return (await m.logits).clone()


async def mask_every_step(m):
    steps = 0
    async for _ in m.steps():
        r = await m.layers[0].mlp.router
        r.scatter_(-1, r.argmax(-1, keepdim=True), float("-inf"))
        steps += 1
    return steps


def test_tp2_moe_points_equal_transformers(tmp_path):
    require_vllm()
    from asyncinterp.models.hf.tiny_moe import tiny_moe_dir
    path = tiny_moe_dir(tmp_path / "mixtral", "mixtral")
    torch.set_grad_enabled(False)
    try:
        from transformers import AutoTokenizer
        lm = ai.LanguageModel(hf_model(path), AutoTokenizer.from_pretrained(path))
        want_read, want_mask = lm.trace(PROMPT, read), lm.trace(PROMPT, mask_top)
        want_gen = lm.generate(PROMPT, mask_every_step, max_new_tokens=3)
        with ai.VLLM(path, tensor_parallel_size=2, **ENGINE) as vm:
            assert vm.tp == 2
            got_read, got_mask = vm.trace(PROMPT, read), vm.trace(PROMPT, mask_top)
            got_gen = vm.generate(PROMPT, mask_every_step, max_new_tokens=3)
    finally:
        torch.set_grad_enabled(True)
    for g, w in zip(got_read + (got_mask,), want_read + (want_mask,)):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, atol=1e-4, rtol=0)
    assert (got_mask - got_read[3]).abs().max() > 1e-3
    assert got_gen.result == want_gen.result == 3 and got_gen.tokens.tolist() == want_gen.tokens.tolist()
