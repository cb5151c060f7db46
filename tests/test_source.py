"""Source-level hook points: calls inside a module's forward, equal to a manual re-implementation."""

import math

import pytest
import torch

import asyncinterp as ai
from asyncinterp.hooks.source import source_info
from conftest import hook_count


def _ids(rows=2, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 100, (rows, T), generator=g)


def test_listing_names_lines_and_discovery(llama_hf):
    before = hook_count(llama_hf)
    m = ai.wrap(llama_hf)
    src = m.model.layers[0].self_attn.source
    text = repr(src)
    names = src.names()
    for name in ("self_q_proj_0", "apply_rotary_pos_emb_0", "attention_interface_0", "self_o_proj_0"):
        assert name in names and name in text
    op = src.attention_interface_0
    assert "attention_interface(" in op.code and op.line > 0
    assert f"{op.line:>4} |" in text
    with pytest.raises(AttributeError, match="attention_interface_0"):
        src.attention_interfac_0
    mlp = m.model.layers[0].mlp.source
    assert mlp.names() == ["self_gate_proj_0", "self_act_fn_0", "self_up_proj_0", "self_down_proj_0"]
    assert hook_count(llama_hf) == before and "forward" not in llama_hf.model.layers[0].self_attn.__dict__


def test_gpt2_attention_weights_equal_manual_reimplementation(gpt2_hf):
    before = hook_count(gpt2_hf)   # transformers may keep hooks of its own on shared fixtures
    m = ai.wrap(gpt2_hf)
    ids = _ids()

    async def weights(m):
        attn = m.transformer.h[1].attn
        out = await attn.source.attention_interface_0.output
        return out[1].clone()

    got = m.trace(ids, weights)

    saved = {}
    attn = gpt2_hf.transformer.h[1].attn
    h = attn.c_attn.register_forward_hook(lambda mod, a, o: saved.update(qkv=o))
    gpt2_hf(ids)
    h.remove()
    q, k, _ = saved["qkv"].split(attn.split_size, dim=2)
    B, T, _ = q.shape
    q = q.view(B, T, attn.num_heads, attn.head_dim).transpose(1, 2)
    k = k.view(B, T, attn.num_heads, attn.head_dim).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(attn.head_dim)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
    want = scores.softmax(-1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert "forward" not in attn.__dict__ and hook_count(gpt2_hf) == before


def test_llama_mlp_call_equals_manual(llama_hf):
    m = ai.wrap(llama_hf)
    ids = _ids(1, 5)

    async def inner(m):
        mlp = m.model.layers[2].mlp
        x, (args, kwargs) = await ai.gather(mlp.input, mlp.source.self_down_proj_0.inputs)
        return x.clone(), args[0].clone()

    x, got = m.trace(ids, inner)
    mlp = llama_hf.model.layers[2].mlp
    with torch.no_grad():
        want = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
    torch.testing.assert_close(got, want)


def test_replacing_a_call_output_equals_hook(llama_hf):
    m = ai.wrap(llama_hf)
    ids = _ids(2, 5, seed=3)

    async def ablate(m):
        attn = m.model.layers[1].self_attn
        out, weights = await attn.source.attention_interface_0.output
        attn.source.attention_interface_0.output = (torch.zeros_like(out), weights)
        return await m.output

    got = m.trace(ids, ablate).logits
    o_proj = llama_hf.model.layers[1].self_attn.o_proj
    h = o_proj.register_forward_pre_hook(lambda mod, a: (torch.zeros_like(a[0]),))
    want = llama_hf(ids).logits
    h.remove()
    assert torch.equal(got, want)


def test_invokes_see_own_rows_of_source_points(llama_hf):
    m = ai.wrap(llama_hf)
    a, b = _ids(1, 5, 1), _ids(2, 5, 2)

    async def read(m):
        out = await m.model.layers[0].self_attn.source.attention_interface_0.output
        return out[1].clone()

    with m.trace() as tr:
        ra = tr.invoke(a, read)
        rb = tr.invoke(b, read)
    full = llama_hf(torch.cat([a, b]), output_attentions=True).attentions[0]
    assert torch.equal(ra.result, full[:1]) and torch.equal(rb.result, full[1:])


def test_source_points_across_generation_steps():
    pytest.importorskip("asyncinterp.models.hf.language")
    from asyncinterp.models import tiny
    lm = tiny("llama")
    shapes = []
    weights = []

    async def per_step(m):
        async for step in m.steps():
            out = await m.model.layers[0].self_attn.source.attention_interface_0.output
            shapes.append(tuple(out[1].shape))
            weights.append(out[1].clone())

    gen = lm.generate("The cat sat", per_step, max_new_tokens=3)
    T = shapes[0][-1]
    assert shapes == [(1, 2, T, T), (1, 2, 1, T + 1), (1, 2, 1, T + 2)]
    # the last step's weights equal the model's own attention output for the full sequence
    seq = gen.sequences if hasattr(gen, "sequences") else None
    full_ids = lm.tokenizer("The cat sat", return_tensors="pt").input_ids
    full_ids = torch.cat([full_ids, gen.tokens[:-1].view(1, -1)], dim=1)
    ref = lm.module(full_ids, output_attentions=True).attentions[0]
    torch.testing.assert_close(weights[2][0, :, 0], ref[0, :, -1], rtol=1e-5, atol=1e-6)
    assert "forward" not in lm.module.model.layers[0].self_attn.__dict__


def test_out_of_order_and_outside_run(llama_hf):
    m = ai.wrap(llama_hf)

    async def at_input(m):
        await m.model.layers[0].mlp.input
        await m.model.layers[0].mlp.source.self_down_proj_0.output

    with pytest.raises(ai.OutOfOrderError, match="gather"):
        m.trace(_ids(), at_input)

    async def late(m):
        await m.model.layers[1].output
        await m.model.layers[0].self_attn.source.attention_interface_0.output

    with pytest.raises(ai.OutOfOrderError, match="attention_interface_0"):
        m.trace(_ids(), late)
    assert "forward" not in llama_hf.model.layers[0].self_attn.__dict__

    async def outside():
        await m.model.layers[0].self_attn.source.attention_interface_0.output

    with pytest.raises(ai.NotInRunError):
        outside().send(None)


def test_rewrite_keeps_semantics_of_tricky_functions():
    class Base(torch.nn.Module):
        def forward(self, x):
            return x + 1

    def make(scale):
        class Child(Base):
            __secret = 3

            def forward(self, x, *rest, k: int = 2, **kw):
                y = super().forward(x) * scale
                z = [torch.relu(v) for v in (y, -y)]
                f = lambda t: t.sum()
                return f(z[0]) + self.__secret + k + len(rest) + len(locals())
        return Child()

    mod = make(2.0)
    m = ai.wrap(mod)
    x = torch.randn(3)
    want = mod(x)
    names = m.source.names()
    assert "torch_relu_0" in names and "f_0" in names and not any(n.startswith("super") for n in names)

    async def read(m):
        return await m.source.torch_relu_0.output

    relu = m.trace(x, read)
    assert torch.equal(relu, torch.relu((x + 1) * 2.0))
    assert torch.equal(m.trace(x), want)
    info = source_info(type(mod).forward, type(mod))
    assert info.filename == __file__


def test_nested_source_in_called_function_pre_softmax_scores(llama_hf):
    from transformers.models.llama.modeling_llama import eager_attention_forward
    m = ai.wrap(llama_hf)
    ids = _ids(2, 6, seed=5)
    op = m.model.layers[1].self_attn.source.attention_interface_0
    inner = op.source_of(eager_attention_forward)   # the callee is chosen at run time: name it
    assert "nn_functional_softmax_0" in inner.names() and "torch_matmul_0" in inner.names()
    assert "attention_interface_0.source" in repr(inner)

    async def scores(m):
        raw = (await inner.torch_matmul_0.output).clone()
        args, kwargs = await inner.nn_functional_softmax_0.inputs
        weights = (await op.output)[1]
        return raw, args[0].clone(), weights.clone()

    raw, masked, weights = m.trace(ids, scores)
    assert op.source.names() == inner.names()          # the callee was seen during the run

    saved = {}
    attn = llama_hf.model.layers[1].self_attn
    hq = attn.q_proj.register_forward_hook(lambda mod, a, o: saved.update(q=o))
    out = llama_hf(ids, output_attentions=True)
    hq.remove()
    torch.testing.assert_close(masked.softmax(-1), weights)
    torch.testing.assert_close(weights, out.attentions[1])
    assert raw.shape == (2, attn.config.num_attention_heads, 6, 6)
    # scaled raw scores equal the masked scores where the causal mask lets them through
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    torch.testing.assert_close((raw * attn.scaling)[..., causal], masked[..., causal])
    assert "forward" not in attn.__dict__


def test_nested_source_of_static_callee(llama_hf):
    m = ai.wrap(llama_hf)
    rope = m.model.layers[0].self_attn.source.apply_rotary_pos_emb_0.source
    assert "rotate_half_0" in rope.names()

    async def read(m):
        half = (await rope.rotate_half_0.output).clone()      # runs inside apply_rotary_pos_emb: first
        q, k = await m.model.layers[0].self_attn.source.apply_rotary_pos_emb_0.output
        return q.clone(), half

    q, half = m.trace(_ids(1, 4), read)
    assert q.shape[-1] == half.shape[-1]


def _doubled_tanh(x):
    y = torch.tanh(x)
    return y * 2


class _Dynamic(torch.nn.Module):
    def forward(self, x):
        f = _doubled_tanh if x.shape[0] else None
        return f(x) + 1


def test_runtime_callee_is_known_after_a_run():
    m = ai.wrap(_Dynamic())
    x = torch.randn(3)
    op = m.source.f_0
    with pytest.raises(AttributeError, match="source_of"):
        op.source

    async def read(m):
        return await m.source.f_0.output

    assert torch.equal(m.trace(x, read), torch.tanh(x) * 2)
    inner = op.source
    assert inner.names() == ["torch_tanh_0"]

    async def nested(m):
        y = await inner.torch_tanh_0.output
        y[:] = 0
        return await m.output

    assert torch.equal(m.trace(x, nested), torch.ones(3))
    assert torch.equal(m.trace(x), torch.tanh(x) * 2 + 1)


def test_source_page_runs(capsys):
    pytest.importorskip("asyncinterp.models.hf.language")
    from docsnippets import python_blocks, run_page
    assert len(python_blocks("source.md")) >= 6
    ns = run_page("source.md")
    out = capsys.readouterr().out
    assert "attention_interface_0" in out and "self_q_proj_0" in out and "torch.Size([2, 4, 6, 6])" in out
    assert "nn_functional_softmax_0" in out
    shapes = ns["shapes"]
    assert len(shapes) == 3 and shapes[1][2] == 1


def test_gradient_of_attention_weights_equals_autograd(llama_hf):
    m = ai.wrap(llama_hf)
    ids = _ids(2, 5, seed=7)

    async def fn(m):
        op = m.model.layers[1].self_attn.source.attention_interface_0
        g = await ai.spawn(op.output.grad)          # gradient w.r.t. attn_output (first tensor)
        logits = await m.lm_head.output
        await m.backward(logits[:, -1, 3].sum())
        return await g

    got = m.trace(ids, fn)
    saved = {}
    o_proj = llama_hf.model.layers[1].self_attn.o_proj
    h = o_proj.register_forward_pre_hook(lambda mod, a: saved.update(x=a[0]))
    logits = llama_hf(ids).logits
    h.remove()
    (want,) = torch.autograd.grad(logits[:, -1, 3].sum(), saved["x"])
    # attn_output is reshaped [B, T, H, D] -> [B, T, H*D] before o_proj
    torch.testing.assert_close(got.reshape(want.shape), want)
    assert "forward" not in llama_hf.model.layers[1].self_attn.__dict__


def test_cleanup_over_many_runs_with_toolkit_features(llama_hf):
    """Source patches, gradient tensor hooks, cache taps and edits leave nothing behind, failing or not."""
    import gc
    import weakref

    m = ai.wrap(llama_hf).edit(_noop_edit)
    ids = _ids(1, 4)
    runs, tensors = [], []
    hooks_before = hook_count(llama_hf)   # transformers keeps its own hooks once output_attentions was used
    for i in range(60):
        cache = ai.Cache(["model.layers.0"])

        async def fn(m, i=i):
            op = m.model.layers[0].self_attn.source.attention_interface_0
            out, w = await op.output
            g = await ai.spawn(m.model.layers[1].output.grad)
            logits = await m.lm_head.output
            if i % 3 == 0:
                raise ValueError("planned failure")
            await m.backward(logits.sum())
            grad = await g
            tensors.append(weakref.ref(grad))
            return w.sum().item()

        tr = m.trace()
        tr.invoke(ids, fn, cache)
        if i % 3 == 0:
            with pytest.raises(ValueError, match="planned"):
                tr.run()
        else:
            tr.run()
        runs.append(weakref.ref(tr))
        del tr, cache, fn
    gc.collect()
    assert hook_count(llama_hf) == hooks_before
    assert all("forward" not in mod.__dict__ for mod in llama_hf.modules())
    assert all(r() is None for r in runs)
    assert all(t() is None for t in tensors)
    for p in llama_hf.parameters():
        p.grad = None


async def _noop_edit(m):
    await m.model.layers[0].output


class _OddDocstring(torch.nn.Module):
    def forward(self, x):
        """A docstring whose second line is not indented:
like this one."""
        return torch.sigmoid(x) * 3


def test_forward_with_unindented_string_literal():
    m = ai.wrap(_OddDocstring())

    async def fn(m):
        return await m.source.torch_sigmoid_0.output

    x = torch.randn(4)
    assert torch.equal(m.trace(x, fn), torch.sigmoid(x))
    assert f"{_OddDocstring.forward.__code__.co_firstlineno:>4} |     def forward" in repr(m.source)
