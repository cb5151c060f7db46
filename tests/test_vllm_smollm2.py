"""asyncinterp on vLLM with the bundled SmolLM2-135M-Instruct (real weights, converted to a local dir)."""

import pytest
import torch

import asyncinterp as ai
from vllm_helpers import ENGINE, hf_model, require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.smollm2]

CLEAN = "The Eiffel Tower is located in the city of"
CORRUPT = "The Colosseum is located in the city of"


@pytest.fixture(scope="module")
def smol_dir():
    require_vllm()
    from asyncinterp.models.hf.bundled import smollm2_dir
    return str(smollm2_dir())


@pytest.fixture(scope="module")
def vm(smol_dir):
    require_vllm()
    model = ai.VLLM(smol_dir, **ENGINE)
    yield model
    model.close()


@pytest.fixture(scope="module")
def hf(smol_dir):
    return hf_model(smol_dir)


def test_hidden_states_and_logits_equal_transformers(vm, hf):
    n_layers = len(vm.model.layers)

    async def read(m):
        hs = [(await m.model.layers[i].hidden).clone() for i in range(n_layers)]
        return hs, (await m.logits).clone()

    hs, logits = vm.trace(CLEAN, read)
    ids = vm.tokenizer(CLEAN, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    # SmolLM2 has massive activations (|h| up to ~2e4 from layer 11 on, where float32's resolution is
    # ~2e-3), so hidden states are compared relative to each tensor's scale: max |diff| <= 1e-4 * max |h|
    # (measured: <= 1.3e-5). The logits (|l| < 30) are compared absolutely.
    for i in range(n_layers - 1):
        want = ref.hidden_states[i + 1]
        assert hs[i].shape == want.shape
        err = (hs[i] - want).abs().max().item()
        assert err <= 1e-4 * want.abs().max().item(), (i, err)
    torch.testing.assert_close(logits, ref.logits[:, -1], atol=1e-4, rtol=1e-4)


def test_greedy_paris_through_logits_and_generation(vm):
    async def top(m):
        return (await m.logits).argmax(-1).item()

    assert vm.decode(vm.trace("The capital of France is", top)) == " Paris"
    assert vm.generate("The capital of France is", max_new_tokens=1).text == " Paris"


def test_patching_clean_residual_restores_paris_early_not_late(vm):
    paris = vm.token_id(" Paris")
    a, b = vm.tokenizer(CLEAN).input_ids, vm.tokenizer(CORRUPT).input_ids
    subject = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    n = len(vm.model.layers)
    layers = [1, n - 2]

    async def record(m):
        return [(await m.model.layers[i].hidden).clone() for i in layers]

    clean = vm.trace(CLEAN, record)

    def patch(k):
        async def fn(m):
            h = await m.model.layers[layers[k]].hidden
            h[:, subject] = clean[k][:, subject]
            return (await m.logits)[0].softmax(-1)[paris].item()
        return fn

    async def p_paris(m):
        return (await m.logits)[0].softmax(-1)[paris].item()

    with vm.trace() as tr:          # one engine step: three requests, each with its own patch
        base = tr.invoke(CORRUPT, p_paris)
        early = tr.invoke(CORRUPT, patch(0))
        late = tr.invoke(CORRUPT, patch(1))
    assert base.result < 0.01
    assert early.result > 0.5
    assert late.result < 0.01


def test_steering_one_request_changes_only_its_tokens(vm):
    prompts = ["The capital of France is", "My favourite colour is", "Once upon a time"]
    direction = torch.randn(vm.model.layers[0].input_layernorm.module.weight.shape[0],
                            generator=torch.Generator().manual_seed(0))

    async def steer(m):
        async for _ in m.steps():
            (await m.model.layers[10].hidden).add_(6.0 * direction)

    def run(fns):
        with vm.generate(max_new_tokens=8) as r:
            invs = [r.invoke(p, *([f] if f else [])) for p, f in zip(prompts, fns)]
        return [i.text for i in invs]

    base = run([None, None, None])
    steered = run([None, steer, None])
    assert steered[0] == base[0] and steered[2] == base[2]
    assert steered[1] != base[1]
