"""``logprobs=k`` / ``prompt_logprobs=k`` on the transformers engine: the raw log-probabilities of the model as it ran.

Checked against the model's own forward (``log_softmax`` of its logits at each position), for a prompt alone,
for prompts of different lengths batched in one left-padded generation, and under an intervention that
steers the residual stream (its edit is in them, as a hand-written torch hook gives).
"""

import pytest
import torch

from asyncinterp.models import tiny

PROMPTS = ["The cat sat on the", "Hi"]


@pytest.fixture(scope="module")
def lm():
    return tiny("llama")


def forward_logprobs(lm, ids, hook=None):
    handle = None if hook is None else lm.module.model.layers[0].register_forward_hook(hook)
    try:
        with torch.no_grad():
            logits = lm.module(torch.tensor([ids])).logits[0]
    finally:
        if handle is not None:
            handle.remove()
    return torch.log_softmax(logits.float(), -1)


def check(lm, inv, prompt, k, hook=None):
    ids = lm.tokenizer(prompt)["input_ids"]
    new = [int(t) for t in inv.tokens]
    lp = forward_logprobs(lm, ids + new, hook)
    assert inv.prompt_logprobs[0] is None and len(inv.prompt_logprobs) == len(ids)
    entries = list(inv.prompt_logprobs[1:]) + list(inv.logprobs)
    assert len(inv.logprobs) == len(new)
    for pos, entry in enumerate(entries):
        token = (ids + new)[pos + 1]
        keys = list(entry)
        assert keys[0] == token                                      # the position's own token first
        top = torch.topk(lp[pos], k).indices.tolist()
        assert keys[1:] == [t for t in top if t != token]            # then the k most likely, in order
        for t, v in entry.items():
            assert abs(v - lp[pos, t].item()) < 1e-4


def test_logprobs_are_the_models_own(lm):
    inv = lm.generate(PROMPTS[0], max_new_tokens=4, logprobs=3, prompt_logprobs=3)
    check(lm, inv, PROMPTS[0], 3)
    assert lm.generate(PROMPTS[0], max_new_tokens=4).logprobs is None       # not asked: none


def test_batched_prompts_of_different_lengths(lm):
    with lm.generate(max_new_tokens=3, logprobs=2, prompt_logprobs=2) as tr:
        invs = [tr.invoke(p) for p in PROMPTS]
    for inv, prompt in zip(invs, PROMPTS):
        check(lm, inv, prompt, 2)


def test_an_interventions_edit_is_in_them(lm):
    async def shift(m):
        async for _ in m.steps():
            (await m.model.layers[0].output).add_(1.0)

    def hook(module, args, out):
        (out[0] if isinstance(out, tuple) else out).add_(1.0)

    inv = lm.generate(PROMPTS[0], shift, max_new_tokens=3, logprobs=2, prompt_logprobs=2)
    check(lm, inv, PROMPTS[0], 2, hook)
    plain = lm.generate(PROMPTS[0], max_new_tokens=3, logprobs=2, prompt_logprobs=2)
    assert abs(plain.prompt_logprobs[2][int(lm.tokenizer(PROMPTS[0])["input_ids"][2])]
               - inv.prompt_logprobs[2][int(lm.tokenizer(PROMPTS[0])["input_ids"][2])]) > 1e-3
