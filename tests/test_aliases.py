"""Standard names: one intervention on GPT-2 and Llama, equal to hooks on the real paths."""

import pytest
import torch

import asyncinterp as ai
from asyncinterp.hooks.aliases import set_alias, standard_names
from conftest import MLP


def _ids():
    return torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(0))


async def portable(m):
    """Zero the attention output of layer 1, read the MLP output of layer 2 and the final norm."""
    attn_out = (await m.layers[1].attn.output)[0]
    attn_out[:] = 0
    mlp = (await m.layers[2].mlp.output).clone()
    normed = (await m.final_norm.output).clone()
    logits = await m.lm_head.output
    return mlp, normed, logits.clone()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_one_intervention_runs_on_both_families(arch, gpt2_hf, llama_hf):
    net = gpt2_hf if arch == "gpt2" else llama_hf
    m = ai.wrap(net)
    mlp, normed, logits = m.trace(_ids(), portable)

    if arch == "gpt2":
        layers, attn, final = net.transformer.h, "attn", net.transformer.ln_f
    else:
        layers, attn, final = net.model.layers, "self_attn", net.model.norm
    saved = {}
    hs = [getattr(layers[1], attn).register_forward_hook(lambda mod, a, o: (o[0].zero_(), None)[1]),
          layers[2].mlp.register_forward_hook(lambda mod, a, o: saved.update(mlp=o.clone())),
          final.register_forward_hook(lambda mod, a, o: saved.update(norm=o.clone()))]
    want = net(_ids()).logits
    for h in hs:
        h.remove()
    assert torch.equal(mlp, saved["mlp"]) and torch.equal(normed, saved["norm"]) and torch.equal(logits, want)


def test_aliases_resolve_to_real_envoys(gpt2_hf, llama_hf):
    g, l = ai.wrap(gpt2_hf), ai.wrap(llama_hf)
    assert g.layers is g.transformer.h and l.layers is l.model.layers
    assert g.layers[0].attn.path == "transformer.h.0.attn"
    assert l.layers[0].attn.path == "model.layers.0.self_attn"
    assert g.embed.path == "transformer.wte" and l.embed.path == "model.embed_tokens"
    assert g.final_norm.path == "transformer.ln_f" and l.final_norm.path == "model.norm"
    assert l.layers[0].attn_norm.path == "model.layers.0.input_layernorm"
    assert g.layers[0].mlp_norm.path == "transformer.h.0.ln_2"
    assert g.layers[0].attn.out_proj.path == "transformer.h.0.attn.c_proj"
    assert l.layers[0].attn.out_proj.path == "model.layers.0.self_attn.o_proj"
    assert g.layers[0].mlp.down_proj.path == "transformer.h.0.mlp.c_proj"
    assert standard_names(l) == {
        "layers": "model.layers", "embed": "model.embed_tokens", "final_norm": "model.norm", "lm_head": "lm_head",
        "layers.0.attn": "model.layers.0.self_attn", "layers.0.attn.out_proj": "model.layers.0.self_attn.o_proj",
        "layers.0.mlp": "model.layers.0.mlp", "layers.0.mlp.down_proj": "model.layers.0.mlp.down_proj",
        "layers.0.mlp.up_proj": "model.layers.0.mlp.up_proj",
        "layers.0.attn_norm": "model.layers.0.input_layernorm",
        "layers.0.mlp_norm": "model.layers.0.post_attention_layernorm"}
    assert standard_names(g)["pos_embed"] == "transformer.wpe"


def test_real_names_win_and_missing_names_still_error():
    torch.manual_seed(0)
    m = ai.wrap(MLP())
    assert m.layers.path == "layers"            # a real child called layers
    with pytest.raises(ai.ModulePathError, match="Did you mean"):
        m.layerz
    with pytest.raises(AttributeError):
        m.final_norm                             # nothing to resolve to
    set_alias(m, "final_norm", "layers.5")
    assert m.final_norm.path == "layers.5"
    with pytest.raises(ValueError):
        set_alias(m, "embed", "nope")


def test_aliases_page_runs(capsys):
    from docsnippets import python_blocks, run_page
    assert len(python_blocks("aliases.md")) >= 4
    run_page("aliases.md")
    out = capsys.readouterr().out
    assert "GPT2LMHeadModel (" in out and "LlamaForCausalLM (" in out
    assert "model.layers.1.self_attn" in out and "backbone.blocks.0" in out
    assert "<hook point model.layers.1.hook_mlp_out>" in out                  # TransformerLens's names


def test_a_name_read_before_set_alias_follows_the_new_alias(gpt2_hf):
    """Envoys keep what a name resolved to (a plain attribute read after the first); set_alias drops it."""
    m = ai.wrap(gpt2_hf)
    assert m.final_norm.path == "transformer.ln_f"
    assert m.final_norm is m.transformer.ln_f      # kept: the same envoy on every read
    set_alias(m, "final_norm", "transformer.h.1")
    assert m.final_norm.path == "transformer.h.1"

    async def read(m):
        return (await m.final_norm.output)[0].clone()

    seen = {}
    h = gpt2_hf.transformer.h[1].register_forward_hook(lambda mod, a, o: seen.update(out=o[0].clone()))
    try:
        got = m.trace(_ids(), read)
        gpt2_hf(_ids())
    finally:
        h.remove()
    assert torch.equal(got, seen["out"])


def test_final_norm_is_refused_where_its_module_runs_twice():
    """nanochat calls model.norm after the embedding and before lm_head: `final_norm` would be its first call."""
    import pytest as _pytest
    from transformers import NanoChatConfig, NanoChatForCausalLM
    import asyncinterp as ai
    from asyncinterp.kernel.errors import ModulePathError
    model = ai.wrap(NanoChatForCausalLM(NanoChatConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                                                        num_hidden_layers=1, num_attention_heads=4,
                                                        num_key_value_heads=4)).eval())
    with _pytest.raises(ModulePathError, match="twice"):
        model.final_norm
    assert model.layers[0] is not None and model.embed is not None
