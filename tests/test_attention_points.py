"""attn.pattern and attn.z at the attention function (hooks/attention.py): per run, per invoke, per step, cleaned up.

The architecture matrix (test_architectures.py) checks the values on every architecture in one forward;
here: the per-run proxy of the block's config is gone after every run (success or failure) and never
installed for points that are not awaited; invokes with padding see their own rows; decode steps see the
keys of earlier steps; an edit of z in one invoke leaves the other alone.
"""

import pytest
import torch

import asyncinterp as ai
from asyncinterp.hooks.attention import KEY
from asyncinterp.models.hf.bundled import tiny_llama


@pytest.fixture(scope="module")
def lm():
    net, tok = tiny_llama(seed=0, tokenizer="gpt2")
    net.config._attn_implementation = "sdpa"
    with torch.no_grad():
        for p in net.parameters():                      # O(1) weights: patterns far from uniform
            if p.dim() >= 2:
                p.normal_(0, 1.5 / p.shape[-1] ** 0.5, generator=torch.Generator().manual_seed(3))
    return ai.LanguageModel(net, tok)


def _configs(net):
    return {id(m): id(m.config) for m in net.modules() if hasattr(m, "config")}


def test_config_proxy_only_during_the_run_and_only_on_the_awaited_block(lm):
    net = lm.module
    before = _configs(net)
    seen = {}

    async def fn(m):
        p = await m.layers[1].attn.pattern
        seen["impl"] = [getattr(layer.self_attn.config, "_attn_implementation") for layer in net.model.layers]
        return p.clone()
    lm.trace("Hello there", fn)
    assert seen["impl"] == ["sdpa", KEY]                 # layer 0 untouched, layer 1 watched
    assert _configs(net) == before

    async def boom(m):
        await m.layers[0].attn.z
        raise RuntimeError("mine")
    with pytest.raises(RuntimeError, match="mine"):
        lm.trace("Hello there", boom)
    assert _configs(net) == before
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in net.modules())

    _ = lm.layers[0].attn.pattern, lm.layers[0].attn.z   # looked up, never awaited: nothing installed
    lm.trace("Hello there", lambda m: _noop(m))
    assert _configs(net) == before


async def _noop(m):
    return (await m.logits).clone()


def test_pattern_and_z_per_invoke_with_padding_equal_solo(lm):
    prompts = ["The quick brown fox jumps over", "Hi"]

    async def fn(m):
        return {"pattern": (await m.layers[1].attn.pattern).clone(), "z": (await m.layers[1].attn.z).clone(),
                "logits": (await m.logits).clone()}
    with torch.no_grad():
        with lm.trace() as tr:
            invs = [tr.invoke(p, fn) for p in prompts]
        solo = [lm.trace(p, fn) for p in prompts]
    for inv, alone in zip(invs, solo):
        n = alone["z"].shape[1]
        assert inv.result["pattern"].shape[-2:] == (n, n) and inv.result["z"].shape[1] == n
        for k in alone:
            torch.testing.assert_close(inv.result[k], alone[k], rtol=1e-4, atol=1e-5)


def test_z_edit_of_one_invoke_leaves_the_other(lm):
    async def ablate(m):
        z = await m.layers[0].attn.z
        z[:, :, 0] = 0
        return (await m.logits).clone()

    with torch.no_grad():
        with lm.trace() as tr:
            a = tr.invoke("The quick brown fox", ablate)
            b = tr.invoke("Hello", _noop)
        plain_b = lm.trace("Hello", _noop)
        solo_a = lm.trace("The quick brown fox", ablate)
        plain_a = lm.trace("The quick brown fox", _noop)
    torch.testing.assert_close(b.result, plain_b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(a.result, solo_a, rtol=1e-4, atol=1e-5)
    assert (a.result - plain_a).abs().max() > 1e-3


def test_pattern_at_every_generation_step_equals_eager_attention_on_the_whole_text(lm):
    async def per_step(m):
        out = []
        async for _ in m.steps():
            out.append((await m.layers[1].attn.pattern).clone())
        return out
    with torch.no_grad():
        gen = lm.generate("The quick brown fox", per_step, max_new_tokens=3)
    ids = lm.tokenizer("The quick brown fox", return_tensors="pt").input_ids
    full = torch.cat([ids, gen.tokens.view(1, -1)[:, :-1]], dim=1)
    net = lm.module
    net.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            ref = net(full, output_attentions=True).attentions[1]
    finally:
        net.config._attn_implementation = "sdpa"
    n = ids.shape[1]
    assert [p.shape[-2:] for p in gen.result] == [(n, n), (1, n + 1), (1, n + 2)]
    torch.testing.assert_close(gen.result[0], ref[..., :n, :n], rtol=1e-4, atol=1e-5)
    for i, p in enumerate(gen.result[1:], 1):
        torch.testing.assert_close(p[..., 0, :], ref[..., n + i - 1, :n + i], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "bloom", "falcon", "gpt_bigcode", "phi3", "mpt"])
@pytest.mark.parametrize("by", ["inplace", "replace"])
def test_fused_qkv_edits_equal_a_hand_written_hook(arch, by):
    """q/k/v of fused projections (contiguous or per-head interleaved): an edit reaches the model exactly."""
    import sys
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import arch_matrix as am
    net = am.build(arch)
    model = ai.wrap(net)
    ids = torch.randint(3, am.VOCAB, (2, am.N), generator=torch.Generator().manual_seed(5))
    layer = am._layers(net)[1]
    _, attn = am._child_by_class(layer, "Attention")
    fused, parts = am.FUSED[arch]
    hd = getattr(attn, "head_dim", None) or net.config.hidden_size // net.config.num_attention_heads

    def hook(mod, args, out):                      # the reference: head 0 of k scaled by -2 in the fused output
        out = out.clone()
        am._heads_of(out, parts, 1, hd, net.config.num_attention_heads)[:, :, 0] *= -2
        return out
    h = getattr(attn, fused).register_forward_hook(hook)
    try:
        with torch.no_grad():
            want = net(ids).logits[:, -1]
    finally:
        h.remove()

    async def fn(m):
        k = await m.layers[1].attn.k
        if by == "inplace":
            k[:, :, 0] *= -2
        else:
            new = k.clone()
            new[:, :, 0] *= -2
            m.layers[1].attn.k = new
        return (await m.output).logits[:, -1].clone()
    with torch.no_grad():
        got = model.trace(ids, fn)
        clean = net(ids).logits[:, -1]
    assert (want - clean).abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
