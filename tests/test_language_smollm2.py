"""Integration tests on the bundled SmolLM2-135M-Instruct (real weights, offline)."""

import pytest
import torch

import asyncinterp as ai

pytestmark = pytest.mark.smollm2

CLEAN = "The Eiffel Tower is located in the city of"
CORRUPT = "The Colosseum is located in the city of"


@pytest.fixture(scope="module")
def lm():
    return ai.models.smollm2()


def test_greedy_next_token_is_paris(lm):
    async def next_token(m):
        return (await m.lm_head.output)[:, -1].argmax(-1)
    with torch.no_grad():
        assert lm.decode(lm.trace("The capital of France is", next_token)) == " Paris"
        assert lm.generate("The capital of France is", max_new_tokens=1).text == " Paris"


def test_patching_subject_positions_restores_paris_early_not_late(lm):
    paris = lm.token_id(" Paris")
    a, b = lm.tokenizer(CLEAN)["input_ids"], lm.tokenizer(CORRUPT)["input_ids"]
    assert len(a) == len(b)
    subject = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    layers = lm.model.layers
    n = len(layers)

    async def record(m):
        return [(await layer.output).clone() for layer in layers]

    def patch(i, clean):
        async def fn(m):
            h = await layers[i].output
            h[:, subject] = clean[i][:, subject]
            return (await m.lm_head.output)[0, -1].softmax(-1)[paris].item()
        return fn

    async def p_paris(m):
        return (await m.lm_head.output)[0, -1].softmax(-1)[paris].item()

    with torch.no_grad():
        clean = lm.trace(CLEAN, record)
        p_corrupt = lm.trace(CORRUPT, p_paris)
        with lm.trace() as tr:        # one batched forward: one invoke per patched layer
            invs = [tr.invoke(CORRUPT, patch(i, clean)) for i in range(n)]
    probs = [inv.result for inv in invs]
    assert p_corrupt < 0.01
    assert min(probs[:5]) > 0.5                      # early layers: the subject carries the answer
    assert max(probs[-3:]) < 0.01                    # last layers: it has already moved on
    assert max(probs[-3:]) < min(probs[:5]) / 10


def test_batched_prompts_equal_solo_on_smollm2(lm):
    prompts = [CLEAN, "Hi", "The capital of France is"]

    async def last(m):
        return (await m.lm_head.output)[:, -1].clone()
    with torch.no_grad():
        solo = [lm.trace(p, last) for p in prompts]
        with lm.trace() as tr:
            invs = [tr.invoke(p, last) for p in prompts]
    for s, inv in zip(solo, invs):
        torch.testing.assert_close(inv.result, s, atol=1e-4, rtol=1e-4)
        assert int(inv.result.argmax()) == int(s.argmax())


def test_steering_smollm2_during_generation(lm):
    from asyncinterp import demo
    with torch.no_grad():
        v = demo.mean_direction(lm, 8, demo.OCEAN, demo.CITY)
        base = lm.generate(demo.STEER_PROMPT, max_new_tokens=12)
        steered = lm.generate(demo.STEER_PROMPT, demo.steer(lm.model.layers[8], v, 2.0), max_new_tokens=12)
        again = lm.generate(demo.STEER_PROMPT, max_new_tokens=12)
    assert steered.text != base.text
    assert again.text == base.text
