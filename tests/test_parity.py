"""One intervention, two engines: TransformerLens-style semantic points (docs/semantic-points.md).

* transformers (GPT-2 and Llama, tiny random models): every semantic point reads what a
  hand-written torch hook on the real modules reads, and an edit at the point moves the
  logits exactly as the equivalent hand-written torch hook does; per invoke with padding;
  free when unused.
* vLLM (marked ``vllm``): the same reads and edits on the same weights (tiny Llama) give the
  same values (1e-4): every semantic point at every layer, an in-place edit and a replacement at
  every writable point, attn.pattern in the prompt step and at decode steps.

The interventions run on vLLM come from ``parity_helpers.py``; the same list runs on SmolLM2
(``test_parity_smollm2.py``) and under tensor parallel 2 (``test_vllm_tp.py``).
"""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import asyncinterp as ai
from asyncinterp.hooks.semantic import PointUnavailableError
from asyncinterp.kernel.errors import ReplacementError
from parity_helpers import PROMPT, VLLM_EDITS, edit_point, read_each_step, read_points
from vllm_helpers import tiny_dir, engines  # noqa: F401 - fixtures are found by name

LAYER = 1


def _gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=101, n_embd=32, n_layer=3, n_head=4, bos_token_id=0,
                                      eos_token_id=0)).eval()


def _llama(attn="sdpa"):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, bos_token_id=0,
                                        eos_token_id=0, attn_implementation=attn)).eval()


# ------------------------------------------------------------------ hand-written torch hooks: the reference
# name -> (module, "out" | "in", get(value) -> the point's value, put(value, delta) -> the edited value)

def _split(width, i, hd):
    def get(t):
        part = t[..., i * width:(i + 1) * width]
        return part.reshape(*part.shape[:-1], -1, hd)

    def put(t, d):
        t = t.clone()
        t[..., i * width:(i + 1) * width] += d.reshape(*d.shape[:-2], -1)
        return t
    return get, put


def _proj(hd):
    return (lambda t: t.reshape(*t.shape[:-1], -1, hd)), (lambda t, d: t + d.reshape(*d.shape[:-2], -1))


def _plain():
    return (lambda t: t), (lambda t, d: t + d)


def _last():
    def put(t, d):
        t = t.clone()
        t[:, -1] += d
        return t
    return (lambda t: t[:, -1]), put


def reference_hooks(net):
    if isinstance(net, GPT2LMHeadModel):
        layer = net.transformer.h[LAYER]
        attn, w, hd = layer.attn, net.config.n_embd, net.config.n_embd // net.config.n_head
        resid_mid = (layer.ln_2, "in", *_plain())
        return {"resid_pre": (layer, "in", *_plain()),
                "q": (attn.c_attn, "out", *_split(w, 0, hd)), "k": (attn.c_attn, "out", *_split(w, 1, hd)),
                "v": (attn.c_attn, "out", *_split(w, 2, hd)),
                "resid_mid": resid_mid, "resid_mid_edit": (attn, "out0", *_plain()),
                "mlp.pre": (layer.mlp.c_fc, "out", *_plain()), "mlp.post": (layer.mlp.c_proj, "in", *_plain()),
                "resid_post": (layer, "out", *_plain()), "logits": (net.lm_head, "out", *_last())}
    layer = net.model.layers[LAYER]
    attn, hd = layer.self_attn, layer.self_attn.head_dim
    return {"resid_pre": (layer, "in", *_plain()),
            "q": (attn.q_proj, "out", *_proj(hd)), "k": (attn.k_proj, "out", *_proj(hd)),
            "v": (attn.v_proj, "out", *_proj(hd)),
            "resid_mid": (layer.post_attention_layernorm, "in", *_plain()),
            "resid_mid_edit": (attn, "out0", *_plain()),   # attn_out + d: the stream after the add moves by d
            "mlp.pre": (layer.mlp.gate_proj, "out", *_plain()), "mlp.post": (layer.mlp.down_proj, "in", *_plain()),
            "resid_post": (layer, "out", *_plain()), "logits": (net.lm_head, "out", *_last())}


def run_reference(net, ids, name, delta=None):
    """(the point's value, the logits) with plain torch hooks; ``delta`` added at the point when given."""
    hooks = reference_hooks(net)
    module, kind, get, put = hooks[f"{name}_edit" if delta is not None and f"{name}_edit" in hooks else name]
    seen = {}
    if kind == "in":
        def pre(mod, args):
            seen["v"] = get(args[0]).clone()
            if delta is not None:
                return (put(args[0], delta),) + args[1:]
        h = module.register_forward_pre_hook(pre)
    else:
        def post(mod, args, out):
            t = out[0] if kind == "out0" else out
            seen["v"] = get(t).clone()
            if delta is not None:
                new = put(t, delta)
                return (new,) + tuple(out[1:]) if kind == "out0" else new
        h = module.register_forward_hook(post)
    try:
        with torch.no_grad():
            logits = net(ids).logits[:, -1]
    finally:
        h.remove()
    return seen["v"], logits


POINTS = ["resid_pre", "q", "k", "v", "resid_mid", "mlp.pre", "mlp.post", "resid_post", "logits"]


def point_of(m, name):
    if name == "logits":
        return m.logits
    layer = m.layers[LAYER]
    if name in ("q", "k", "v"):
        return getattr(layer.attn, name)
    if name.startswith("mlp."):
        return getattr(layer.mlp, name[4:])
    return getattr(layer, name)


def read_and_logits(model, ids, name, delta=None, by="inplace"):
    async def fn(m):
        point = point_of(m, name)
        x = await point
        value = x.clone()
        if delta is not None:
            if by == "inplace":
                x += delta
            else:
                point.replace(x + delta)
        return value, (await m.output).logits[:, -1].clone()
    with torch.no_grad():
        return model.trace(ids, fn)


# ------------------------------------------------------------------ transformers


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("name", POINTS)
def test_reads_and_edits_equal_hand_written_torch_hooks(family, name):
    net = _gpt2() if family == "gpt2" else _llama()
    model = ai.wrap(net)
    ids = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(1))
    ref, clean = run_reference(net, ids, name)
    got, logits = read_and_logits(model, ids, name)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(logits, clean, rtol=0, atol=0)
    delta = 0.5 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    _, edited_ref = run_reference(net, ids, name, delta)
    assert (edited_ref - clean).abs().max() > 1e-4, "the edit must move the logits"
    for by in ("inplace", "replace"):
        _, edited = read_and_logits(model, ids, name, delta, by)
        torch.testing.assert_close(edited, edited_ref, rtol=1e-5, atol=1e-5)


def test_shapes_and_names():
    model = ai.wrap(_llama())
    ids = torch.randint(1, 100, (2, 5))

    async def fn(m):
        a = m.layers[1].attn
        return {n: tuple((await p).shape) for n, p in [
            ("resid_pre", m.layers[1].resid_pre), ("q", a.q), ("k", a.k), ("v", a.v), ("pattern", a.pattern),
            ("resid_mid", m.layers[1].resid_mid), ("pre", m.layers[1].mlp.pre), ("post", m.layers[1].mlp.post),
            ("resid_post", m.layers[1].resid_post), ("logits", m.logits)]}
    shapes = model.trace(ids, fn)
    assert shapes == {"resid_pre": (2, 5, 32), "q": (2, 5, 4, 8), "k": (2, 5, 2, 8), "v": (2, 5, 2, 8),
                      "pattern": (2, 4, 5, 5), "resid_mid": (2, 5, 32), "pre": (2, 5, 64), "post": (2, 5, 64),
                      "resid_post": (2, 5, 32), "logits": (2, 101)}
    assert model.layers[1].attn.q.describe() == "model.layers.1.self_attn.q"
    assert model.layers[1].resid_mid.describe() == "model.layers.1.resid_mid"
    assert model.layers[1].resid_mid is model.layers[1].resid_mid


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_pattern_equals_eager_attention_weights(family):
    net = _gpt2() if family == "gpt2" else _llama()
    net.config._attn_implementation = "sdpa"          # our pattern is computed; the model runs its fused kernel
    model = ai.wrap(net)
    ids = torch.randint(1, 100, (2, 7), generator=torch.Generator().manual_seed(3))

    async def fn(m):
        q = (await m.layers[LAYER].attn.q).clone()     # read q first: the pattern is activated mid-block
        return q, (await m.layers[LAYER].attn.pattern).clone()

    async def early(m):
        return (await m.layers[LAYER].attn.pattern).clone()
    _, pattern = model.trace(ids, fn)
    pattern2 = model.trace(ids, early)
    net.config._attn_implementation = "eager"
    for mod in net.modules():
        if hasattr(mod, "config") and hasattr(mod.config, "_attn_implementation"):
            mod.config._attn_implementation = "eager"
    with torch.no_grad():
        ref = net(ids, output_attentions=True).attentions[LAYER]
    torch.testing.assert_close(pattern, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pattern2, ref, rtol=1e-5, atol=1e-6)


def test_pattern_is_read_only():
    model = ai.wrap(_gpt2())

    async def fn(m):
        p = await m.layers[0].attn.pattern
        m.layers[0].attn.pattern.replace(p * 0)
    with pytest.raises(ReplacementError, match="read-only"):
        model.trace(torch.randint(1, 100, (1, 4)), fn)


def test_language_model_per_invoke_with_padding_equals_solo():
    from asyncinterp.models.hf.bundled import tiny_llama
    net, tok = tiny_llama(seed=0, tokenizer="gpt2")
    lm = ai.LanguageModel(net, tok)
    prompts = ["The quick brown fox jumps over", "Hello"]

    async def fn(m):
        layer = m.layers[1]
        out = {"resid_pre": (await layer.resid_pre).clone(), "q": (await layer.attn.q).clone()}
        out["pattern"] = (await layer.attn.pattern).clone()
        out["resid_mid"] = (await layer.resid_mid).clone()
        out["post"] = (await layer.mlp.post).clone()
        out["resid_post"] = (await layer.resid_post).clone()
        out["logits"] = (await m.logits).clone()
        return out

    with torch.no_grad():
        with lm.trace() as tr:
            invs = [tr.invoke(p, fn) for p in prompts]
        solo = [lm.trace(p, fn) for p in prompts]
    for inv, alone, p in zip(invs, solo, prompts):
        n = len(tok(p).input_ids)
        assert inv.result["resid_mid"].shape[1] == n and inv.result["pattern"].shape[-2:] == (n, n)
        assert inv.result["logits"].shape == (1, len(tok))
        for k in alone:
            torch.testing.assert_close(inv.result[k], alone[k], rtol=1e-4, atol=1e-5)


def test_logits_in_a_trace_edits_the_output():
    from asyncinterp.models.hf.bundled import tiny_llama
    net, tok = tiny_llama(seed=0, tokenizer="gpt2")
    lm = ai.LanguageModel(net, tok)

    async def fn(m):
        logits = await m.logits
        logits[:, 7] = 1e4
        return (await m.output).logits[:, -1].argmax(-1)
    assert lm.trace("Hello there", fn).tolist() == [7]

    async def gen(m):
        return (await m.logits).shape          # in a generation: the scores tap, as before
    assert lm.generate("Hello", gen, max_new_tokens=1).result == (1, len(tok))


def test_unused_semantic_points_cost_nothing():
    net = _llama()
    model = ai.wrap(net)
    ids = torch.randint(1, 100, (1, 5))

    def hook_count():
        return sum(len(mod._forward_hooks) + len(mod._forward_pre_hooks) for mod in net.modules())

    seen = {}

    async def plain(m):
        seen["during"] = hook_count()
        return (await m.layers[2].output).clone()

    async def semantic(m):
        seen["during_sem"] = hook_count()
        return (await m.layers[2].resid_post).clone()
    _ = model.layers[1].resid_mid, model.layers[1].attn.q     # looked up, never awaited: nothing installed
    assert hook_count() == 0
    a = model.trace(ids, plain)
    b = model.trace(ids, semantic)
    torch.testing.assert_close(a, b)
    assert seen["during"] == seen["during_sem"]              # resid_post is the layer's own output hook
    assert hook_count() == 0


# ------------------------------------------------------------------ vLLM: same weights, same values

@pytest.mark.vllm
def test_vllm_reads_equal_transformers(engines):
    lm, vm = engines
    fn = read_points(len(vm.layers))
    with torch.no_grad():
        hf = lm.trace(PROMPT, fn)
    vl = vm.trace(PROMPT, fn)
    assert hf.keys() == vl.keys()
    n = len(vm.tokenizer(PROMPT).input_ids)
    assert vl["1.q"].shape == (1, n, 2, 32) and vl["1.k"].shape == (1, n, 1, 32)
    assert vl["1.pattern"].shape == (1, 2, n, n)
    for k in hf:
        assert hf[k].shape == vl[k].shape, k
        torch.testing.assert_close(vl[k], hf[k], rtol=1e-4, atol=1e-4, msg=lambda s, k=k: f"{k}: {s}")


@pytest.mark.vllm
@pytest.mark.parametrize("by", ["inplace", "replace"])
@pytest.mark.parametrize("name", VLLM_EDITS)
def test_vllm_edits_move_logits_like_transformers(engines, name, by):
    lm, vm = engines
    with torch.no_grad():
        clean = lm.trace(PROMPT, read_points(0))["logits"]
        hf = lm.trace(PROMPT, edit_point(1, name, 5, by))
    vl = vm.trace(PROMPT, edit_point(1, name, 5, by))
    assert (hf - clean).abs().max() > 1e-3
    torch.testing.assert_close(vl, hf, rtol=1e-4, atol=1e-4)


@pytest.mark.vllm
def test_vllm_pattern_in_generation_equals_transformers(engines):
    """Decode steps: the pattern covers the keys of earlier steps (kept by the point from step 0)."""
    lm, vm = engines
    with torch.no_grad():
        hf = lm.generate(PROMPT, read_each_step(1, ("q", "pattern")), max_new_tokens=4)
    vl = vm.generate(PROMPT, read_each_step(1, ("q", "pattern")), max_new_tokens=4)
    assert vl.tokens.tolist() == hf.tokens.tolist()[-4:]
    n = len(vm.tokenizer(PROMPT).input_ids)
    assert [s["pattern"].shape for s in vl.result] == [(1, 2, n, n)] + [(1, 2, 1, n + i) for i in range(1, 4)]
    for step, ref in zip(vl.result, hf.result):
        assert step.keys() == ref.keys()
        for k in step:
            torch.testing.assert_close(step[k], ref[k], rtol=1e-4, atol=1e-4)


@pytest.mark.vllm
def test_vllm_qkv_edit_of_one_request_leaves_the_others(engines):
    _, vm = engines
    prompts = [PROMPT, "Hello world, this is"]

    async def ablate(m):
        v = await m.layers[1].attn.v
        v[:] = 0
        return (await m.logits).clone()

    async def plain(m):
        return (await m.logits).clone()

    with vm.trace() as tr:
        a = tr.invoke(prompts[0], ablate)
        b = tr.invoke(prompts[1], plain)
    torch.testing.assert_close(b.result, vm.trace(prompts[1], plain))
    torch.testing.assert_close(a.result, vm.trace(prompts[0], ablate))
    assert (a.result - vm.trace(prompts[0], plain)).abs().max() > 1e-3


@pytest.mark.vllm
def test_vllm_pattern_is_read_only_and_needs_its_first_step(engines):
    _, vm = engines

    async def assign(m):
        p = await m.layers[0].attn.pattern
        m.layers[0].attn.pattern = p * 0
    with pytest.raises(ReplacementError, match=r"model\.layers\.0\.self_attn\.pattern is read-only"):
        vm.trace(PROMPT, assign)

    async def late(m):
        async for step in m.steps():
            if step == 2:
                return await m.layers[0].attn.pattern
    with pytest.raises(PointUnavailableError, match="(?s)positions 0..*first step"):
        vm.generate(PROMPT, late, max_new_tokens=4)

    async def whole(m):
        return await m.layers[0].attn.pattern
    with pytest.raises(PointUnavailableError, match="per request"):
        with vm.trace() as tr:
            tr.invoke(whole)
            tr.invoke(PROMPT)


def test_semantic_points_page_runs(capsys):
    from docsnippets import python_blocks, run_page
    assert len(python_blocks("semantic-points.md")) >= 5
    run_page("semantic-points.md")
    out = capsys.readouterr().out
    assert "GPT2LMHeadModel {'resid_pre': (2, 5, 32), 'q': (2, 5, 4, 8)" in out
    assert "'k': (2, 5, 2, 8)" in out and "True" in out


@pytest.mark.vllm
def test_vllm_gradients_raise_clearly(engines):
    _, vm = engines

    async def grad(m):
        return await m.layers[0].resid_post.grad

    async def backward(m):
        h = await m.layers[0].resid_post
        await m.backward(h.sum())
    for fn in (grad, backward):
        with pytest.raises(PointUnavailableError, match="inference_mode"):
            vm.trace(PROMPT, fn)


@pytest.mark.vllm
def test_submitted_code_uses_the_same_names_on_both_engines(engines):
    """Code submitted to a server (the sandbox) reads and writes semantic points on vLLM as on transformers."""
    from asyncinterp.serve.sandbox import Program
    lm, vm = engines
    src = '''
async def f(m):
    q = await m.layers[1].attn.q
    mid = await m.layers[1].resid_mid
    m.layers[1].mlp.post = (await m.layers[1].mlp.post) * 3
    return {"q": q, "mid": mid, "logits": await m.logits}
'''
    with torch.no_grad():
        hf = lm.trace(PROMPT, Program(src).bind({})[0])
        clean = lm.trace(PROMPT, read_points(0))["logits"]
    vl = vm.trace(PROMPT, Program(src).bind({})[0])
    assert (hf["logits"] - clean).abs().max() > 1e-3          # the write went through
    for k in hf:
        torch.testing.assert_close(vl[k], hf[k], rtol=1e-4, atol=1e-4, msg=lambda s, k=k: f"{k}: {s}")
