"""LoRA adapters (peft) on a LanguageModel: tiny random Llama, two random adapters, against hand-written hooks."""

import pytest
import torch

pytest.importorskip("peft")

import asyncinterp as ai  # noqa: E402
from asyncinterp.models.hf.lora import PeftLanguageModel, tiny_lora_llama  # noqa: E402

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def lora():
    torch.set_grad_enabled(False)
    pm, tok = tiny_lora_llama()
    yield ai.LanguageModel(pm, tok), pm, tok
    torch.set_grad_enabled(True)


def q_proj(pm):
    return pm.get_base_model().model.layers[0].self_attn.q_proj


def reference_logits(pm, tok, adapter=None, hook=None):
    """A plain peft forward, with ``adapter`` set by hand (and put back) and ``hook`` = (module, fn) registered."""
    enc = tok(PROMPT, return_tensors="pt")
    previous = pm.active_adapter
    if adapter is not None:
        pm.set_adapter(adapter)
    handle = hook[0].register_forward_hook(hook[1]) if hook else None
    try:
        return pm(**enc).logits
    finally:
        if handle is not None:
            handle.remove()
        pm.set_adapter(previous)


def test_wraps_peft_model(lora):
    model, pm, _ = lora
    assert isinstance(model, PeftLanguageModel) and model.adapters == ["red", "blue"]
    assert model.active_adapter == "red"
    assert model.model.layers[0].self_attn.q_proj.lora_A["blue"].module is q_proj(pm).lora_A["blue"]


def test_reads_equal_hand_written_hooks(lora):
    model, pm, tok = lora

    async def read(m):
        a = (await m.model.layers[0].self_attn.q_proj.lora_A["red"].output).clone()
        return a, (await m.lm_head.output).clone()

    got_a, got_logits = model.trace(PROMPT, read)
    seen = []
    ref = reference_logits(pm, tok, hook=(q_proj(pm).lora_A["red"], lambda mod, i, o: seen.append(o.clone())))
    torch.testing.assert_close(got_a, seen[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(got_logits, ref, atol=1e-6, rtol=0)


def test_adapter_per_run_equals_set_adapter_by_hand(lora):
    model, pm, tok = lora

    async def logits(m):
        return (await m.lm_head.output).clone()

    flags = [p.requires_grad for p in pm.parameters()]
    red = model.trace(PROMPT, logits)
    blue = model.trace(PROMPT, logits, adapter="blue")
    assert model.active_adapter == "red" and [p.requires_grad for p in pm.parameters()] == flags
    torch.testing.assert_close(red, reference_logits(pm, tok), atol=1e-6, rtol=0)
    torch.testing.assert_close(blue, reference_logits(pm, tok, adapter="blue"), atol=1e-6, rtol=0)
    assert (red - blue).abs().max() > 1e-3

    with model.trace(adapter="blue") as tr:       # a with block: both invokes use "blue"
        x = tr.invoke(PROMPT, logits)
        y = tr.invoke("Another prompt here", logits)
    torch.testing.assert_close(x.result, blue, atol=1e-5, rtol=0)
    assert y.result.shape[1] > 0 and model.active_adapter == "red"


def test_adapter_restored_after_failure(lora):
    model, pm, _ = lora

    async def boom(m):
        await m.model.layers[0].output
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        model.trace(PROMPT, boom, adapter="blue")
    assert model.active_adapter == "red"
    with pytest.raises(ValueError, match="no adapter 'green'"):
        model.trace(PROMPT, boom, adapter="green")


def test_edit_lora_output_equals_hand_written_hook(lora):
    model, pm, tok = lora

    async def double_b(m):
        h = await m.model.layers[0].self_attn.q_proj.lora_B["blue"].output
        h *= 2
        return (await m.lm_head.output).clone()

    got = model.trace(PROMPT, double_b, adapter="blue")
    ref = reference_logits(pm, tok, adapter="blue", hook=(q_proj(pm).lora_B["blue"], lambda mod, i, o: o * 2))
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)
    assert (got - reference_logits(pm, tok, adapter="blue")).abs().max() > 1e-4


def test_generate_with_adapter_equals_set_adapter_by_hand(lora):
    model, pm, tok = lora
    out = model.generate(PROMPT, max_new_tokens=4, adapter="blue")
    enc = tok(PROMPT, return_tensors="pt")
    pm.set_adapter("blue")
    try:
        ref = pm.get_base_model().generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.eos_token_id)
    finally:
        pm.set_adapter("red")
    assert len(out.tokens) > 0
    assert out.tokens.tolist() == ref[0, enc["input_ids"].shape[1]:].tolist()[:len(out.tokens)]
    assert model.active_adapter == "red"


def test_async_runs_take_the_adapter(lora):
    import asyncio
    model, pm, tok = lora

    async def logits(m):
        return (await m.lm_head.output).clone()

    async def both():
        return await model.atrace(PROMPT, logits, adapter="blue"), await model.atrace(PROMPT, logits)

    blue, red = asyncio.run(both())
    torch.testing.assert_close(blue, reference_logits(pm, tok, adapter="blue"), atol=1e-6, rtol=0)
    torch.testing.assert_close(red, reference_logits(pm, tok), atol=1e-6, rtol=0)
    out = asyncio.run(model.agenerate(PROMPT, logits, max_new_tokens=2, adapter="blue"))
    assert out.result is not None and model.active_adapter == "red"
