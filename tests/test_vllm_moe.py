"""Mixture-of-experts points on vLLM (tiny random Mixtral, FusedMoE on CPU) against transformers and hand-written hooks.

One vLLM engine for the module; the transformers model loads the same directory.
"""

import pytest
import torch

import asyncinterp as ai
from asyncinterp.kernel.errors import ReplacementError
from vllm_helpers import ENGINE, hf_model, require_vllm

pytestmark = pytest.mark.vllm

PROMPTS = ["The quick brown fox jumps", "Hi", "Once upon a time in a land far away"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    require_vllm()
    from asyncinterp.models.hf.tiny_moe import tiny_moe_dir
    path = tiny_moe_dir(tmp_path_factory.mktemp("vllm-moe") / "mixtral", "mixtral")
    torch.set_grad_enabled(False)
    vm = ai.VLLM(path, **ENGINE)
    lm = ai.LanguageModel(hf_model(path), vm.tokenizer)
    yield lm, vm
    vm.close()
    torch.set_grad_enabled(True)


def runner_model(vm):
    return vm.llm_engine.model_executor.driver_worker.worker.model_runner.model


async def read(m):
    block = m.layers[1].mlp                    # vLLM: block_sparse_moe, through the standard name
    r = (await block.router).clone()
    e = (await block.per_expert).clone()
    o = (await block.routed).clone()
    return r, e, o, (await m.logits).clone()


async def mask_top(m):
    r = await m.layers[0].mlp.router
    r.scatter_(-1, r.argmax(-1, keepdim=True), float("-inf"))
    return (await m.logits).clone()


def test_points_on_vllm_blocks(engines):
    _, vm = engines
    block = vm.layers[0].mlp
    assert block.path == "model.layers.0.block_sparse_moe"
    assert block.router.describe() == "model.layers.0.block_sparse_moe.router"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_same_values_on_both_engines(engines, prompt):
    lm, vm = engines
    for fn in (read, mask_top):
        got, want = vm.trace(prompt, fn), lm.trace(prompt, fn)
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, atol=1e-4, rtol=0)


def test_mask_takes_effect_and_equals_hand_written_hook(engines):
    """A hand-written forward hook on vLLM's gate that masks the first choice, run through vllm's own generate."""
    from vllm import SamplingParams
    _, vm = engines
    model = runner_model(vm)
    seen = {}

    def hand_mask(mod, args, out):
        logits = out[0] if isinstance(out, tuple) else out
        logits.scatter_(-1, logits.argmax(-1, keepdim=True), float("-inf"))

    def on_logits(mod, args, out):
        seen["logits"] = out[-1].clone()

    hooks = [model.model.layers[0].block_sparse_moe.gate.register_forward_hook(hand_mask),
             model.logits_processor.register_forward_hook(on_logits)]
    try:
        vm.llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    finally:
        for h in hooks:
            h.remove()
    got = vm.trace(PROMPTS[0], mask_top)
    torch.testing.assert_close(got[0], seen["logits"], atol=1e-5, rtol=0)
    assert (got - vm.trace(PROMPTS[0], read)[3]).abs().max() > 1e-3


def test_routed_edit_equals_hand_written_hook(engines):
    from vllm import SamplingParams
    _, vm = engines
    model = runner_model(vm)
    seen = {}

    async def double(m):
        o = await m.layers[0].mlp.routed
        o *= 2
        return (await m.logits).clone()

    hooks = [model.model.layers[0].block_sparse_moe.experts.register_forward_hook(lambda mod, a, out: out * 2),
             model.logits_processor.register_forward_hook(lambda mod, a, out: seen.__setitem__("l", out[-1].clone()))]
    try:
        vm.llm.generate([PROMPTS[1]], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    finally:
        for h in hooks:
            h.remove()
    torch.testing.assert_close(vm.trace(PROMPTS[1], double)[0], seen["l"], atol=1e-5, rtol=0)


def test_batched_equals_solo(engines):
    _, vm = engines
    fns = [read, mask_top, read]
    with vm.trace() as tr:
        invs = [tr.invoke(p, f) for p, f in zip(PROMPTS, fns)]
    for inv, p, f in zip(invs, PROMPTS, fns):
        solo = vm.trace(p, f)
        for g, s in zip(inv.result if isinstance(solo, tuple) else (inv.result,),
                        solo if isinstance(solo, tuple) else (solo,)):
            torch.testing.assert_close(g, s, atol=1e-5, rtol=0)


def test_per_expert_is_read_only(engines):
    _, vm = engines

    async def write(m):
        e = await m.layers[0].mlp.per_expert
        m.layers[0].mlp.per_expert.replace(torch.zeros_like(e))

    with pytest.raises(ReplacementError, match="per_expert is read-only"):
        vm.trace(PROMPTS[0], write)


def test_generation_masked_every_step_matches_transformers(engines):
    lm, vm = engines
    n = 4

    async def steer(m):
        steps = 0
        async for _ in m.steps():
            r = await m.layers[0].mlp.router
            r.scatter_(-1, r.argmax(-1, keepdim=True), float("-inf"))
            steps += 1
        return steps

    got = vm.generate(PROMPTS[0], steer, max_new_tokens=n)
    want = lm.generate(PROMPTS[0], steer, max_new_tokens=n)
    assert got.result == want.result == n
    assert got.tokens.tolist() == want.tokens.tolist()
