"""Mixture-of-experts points on transformers (Mixtral, Qwen2-MoE, OLMoE built in code) against hand-written hooks."""

import pytest
import torch

import asyncinterp as ai
from asyncinterp.hooks.moe import MoEPoint, route
from asyncinterp.kernel.errors import ModulePathError, ReplacementError
from asyncinterp.models.hf.tiny_moe import FAMILIES, tiny_moe

PROMPTS = ["The quick brown fox jumps", "Hi", "Once upon a time in a land far away"]


@pytest.fixture(scope="module", params=FAMILIES)
def moe(request):
    torch.set_grad_enabled(False)
    model, tok = tiny_moe(request.param)
    yield ai.LanguageModel(model, tok), model, tok
    torch.set_grad_enabled(True)


async def read(m):
    block = m.layers[1].mlp
    r = (await block.router).clone()
    e = (await block.per_expert).clone()
    o = (await block.routed).clone()
    return r, e, o, (await m.logits).clone()


async def mask_top(m):
    """Mask each token's first-choice expert in layer 0 (its router logit to -inf)."""
    r = await m.layers[0].mlp.router
    r.scatter_(-1, r.argmax(-1, keepdim=True), float("-inf"))
    return (await m.logits).clone()


def by_hand(model, tok, prompt, hooks=()):
    """A plain forward with hand-written torch hooks ``(module, kind, fn)``; returns last-position logits."""
    handles = [mod.register_forward_hook(fn) if kind == "out" else mod.register_forward_pre_hook(fn)
               for mod, kind, fn in hooks]
    try:
        return model(**tok(prompt, return_tensors="pt")).logits[:, -1]
    finally:
        for h in handles:
            h.remove()


def test_points_are_moe_points(moe):
    lm, model, _ = moe
    block = lm.layers[0].mlp
    assert isinstance(block.router, MoEPoint) and block.router.describe() == "model.layers.0.mlp.router"
    assert isinstance(block.gate.output, MoEPoint)          # the router's own output re-routes too
    assert block.experts.module is model.model.layers[0].mlp.experts


def test_reads_equal_hand_written_hooks(moe):
    lm, model, tok = moe
    prompt = PROMPTS[0]
    block = model.model.layers[1].mlp
    seen = {}
    n = len(tok(prompt)["input_ids"])
    hooks = [(block.gate, "out", lambda mod, a, out: seen.__setitem__("logits", out[0].clone())),
             (block.experts, "pre", lambda mod, a: seen.__setitem__("x", a[0].clone())),
             (block.experts, "out", lambda mod, a, out: seen.__setitem__("routed", out.clone()))]
    ref_logits = by_hand(model, tok, prompt, hooks)
    r, e, o, logits = lm.trace(prompt, read)
    E = r.shape[-1]
    torch.testing.assert_close(r, seen["logits"].view(1, n, E), atol=1e-6, rtol=0)
    torch.testing.assert_close(o, seen["routed"].view(1, n, -1), atol=1e-6, rtol=0)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
    x = seen["x"]
    for k in range(E):                                     # each expert as a plain gated MLP by hand
        gate, up = torch.nn.functional.linear(x, block.experts.gate_up_proj[k]).chunk(2, dim=-1)
        ref = torch.nn.functional.linear(block.experts.act_fn(gate) * up, block.experts.down_proj[k])
        torch.testing.assert_close(e[0, :, k], ref, atol=1e-5, rtol=0)
    w, idx = route(block.gate, seen["logits"], torch.empty(0))   # routed = the top-k weighted experts
    chosen = e[0].gather(1, idx[..., None].expand(-1, -1, e.shape[-1]))
    torch.testing.assert_close((chosen * w[..., None]).sum(1), o[0], atol=1e-5, rtol=0)


def test_batched_equals_solo(moe):
    lm, _, _ = moe
    with lm.trace() as tr:
        invs = [tr.invoke(p, read) for p in PROMPTS]
    for inv, p in zip(invs, PROMPTS):
        solo = lm.trace(p, read)
        for got, want in zip(inv.result, solo):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_mask_equals_hand_written_routing(moe):
    """Masking the first-choice expert = a hand-written hook that masks the logits and routes again."""
    lm, model, tok = moe
    gate = model.model.layers[0].mlp.gate

    def hand_mask(mod, args, out):
        logits = out[0].clone()
        logits.scatter_(-1, logits.argmax(-1, keepdim=True), float("-inf"))
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        w, idx = torch.topk(probs, mod.top_k, dim=-1)
        if getattr(mod, "norm_topk_prob", True):
            w = w / w.sum(-1, keepdim=True)
        return logits, w.to(out[1].dtype), idx

    for p in PROMPTS:
        got = lm.trace(p, mask_top)
        ref = by_hand(model, tok, p, [(gate, "out", hand_mask)])
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
        assert (got - by_hand(model, tok, p)).abs().max() > 1e-3      # the mask took effect


def test_gate_output_edit_is_not_a_silent_no_op(moe):
    """nnsight's warning: on transformers, editing ``gate.output[0]`` by hand changes nothing. Here it re-routes."""
    lm, model, tok = moe
    p = PROMPTS[0]
    gate = model.model.layers[0].mlp.gate

    def naive(mod, args, out):                    # the hand-written edit nnsight warns about
        out[0].scatter_(-1, out[0].argmax(-1, keepdim=True), float("-inf"))

    plain = by_hand(model, tok, p)
    torch.testing.assert_close(by_hand(model, tok, p, [(gate, "out", naive)]), plain, atol=0, rtol=0)

    async def via_gate(m):
        logits, weights, indices = await m.layers[0].mlp.gate.output
        assert logits.shape[:2] == weights.shape[:2] == indices.shape[:2]      # [b, n, ...] per invoke
        logits.scatter_(-1, logits.argmax(-1, keepdim=True), float("-inf"))
        return (await m.logits).clone()

    torch.testing.assert_close(lm.trace(p, via_gate), lm.trace(p, mask_top), atol=0, rtol=0)


def _mask_first(logits):
    masked = logits.clone()
    masked.scatter_(-1, masked.argmax(-1, keepdim=True), float("-inf"))
    return masked


def test_replaced_gate_tuple_with_masked_logits_reroutes(moe):
    """Issue 33: ``gate.output = (masked_logits, w, idx)`` (w, idx the awaited views, unchanged) was a silent no-op
    (the weights and indices were tested by object identity). It re-routes from the given logits, like a
    hand-written hook that masks and routes again, and like the in-place mask."""
    lm, model, tok = moe
    gate = model.model.layers[0].mlp.gate

    def hand(mod, args, out):                     # the same replacement by hand, routed again from the logits
        logits = _mask_first(out[0])
        w, idx = route(mod, logits, out[1])
        return logits, w, idx

    async def replace_tuple(m):
        logits, w, idx = await m.layers[0].mlp.gate.output
        m.layers[0].mlp.gate.output = (_mask_first(logits), w, idx)
        return (await m.logits).clone()

    for p in PROMPTS:
        got = lm.trace(p, replace_tuple)
        torch.testing.assert_close(got, by_hand(model, tok, p, [(gate, "out", hand)]), atol=1e-5, rtol=0)
        torch.testing.assert_close(got, lm.trace(p, mask_top), atol=0, rtol=0)
        assert (got - by_hand(model, tok, p)).abs().max() > 1e-3     # not the unmasked run


def test_replaced_gate_tuple_with_new_routing_is_used_as_given(moe):
    """Weights and indices that differ from the router's are kept as given (no re-routing), as a hand hook
    returning the same tuple does; with several invokes, each one's replacement touches only its rows."""
    lm, model, tok = moe
    gate = model.model.layers[0].mlp.gate

    def swap(logits, w, idx):
        """Every token uses its two experts in reverse order of weight, and the logits say something else."""
        return _mask_first(logits), w.flip(-1).contiguous(), idx.clone()

    def hand(mod, args, out):
        return swap(*out)

    async def replace_tuple(m):
        logits, w, idx = await m.layers[0].mlp.gate.output
        m.layers[0].mlp.gate.output = swap(logits, w, idx)
        return (await m.logits).clone()

    async def logits_only(m):
        return (await m.logits).clone()

    for p in PROMPTS[:2]:
        got = lm.trace(p, replace_tuple)
        torch.testing.assert_close(got, by_hand(model, tok, p, [(gate, "out", hand)]), atol=1e-5, rtol=0)
        assert (got - lm.trace(p, mask_top)).abs().max() > 1e-3       # not re-routed from the masked logits
    with lm.trace() as tr:
        a = tr.invoke(PROMPTS[0], replace_tuple)
        b = tr.invoke(PROMPTS[2], logits_only)
    torch.testing.assert_close(a.result, lm.trace(PROMPTS[0], replace_tuple), atol=1e-5, rtol=0)
    torch.testing.assert_close(b.result, lm.trace(PROMPTS[2], logits_only), atol=1e-5, rtol=0)


def test_in_place_weight_edit_with_in_place_mask_keeps_the_weights(moe):
    """Editing the logits *and* the weights in place: the edited weights win for the tokens whose weights
    changed (they are compared by value with the router's, not by identity)."""
    lm, model, tok = moe
    gate = model.model.layers[0].mlp.gate
    p = PROMPTS[0]

    def hand(mod, args, out):
        w = out[1].clone()
        w[0] = w[0].flip(-1)                      # token 0's weights swapped; the others re-routed from the mask
        logits = _mask_first(out[0])
        rw, ri = route(mod, logits, out[1])
        rw[0], ri[0] = w[0], out[2][0]
        return logits, rw, ri

    async def edit(m):
        logits, w, idx = await m.layers[0].mlp.gate.output
        logits.scatter_(-1, logits.argmax(-1, keepdim=True), float("-inf"))
        w[0, 0] = w[0, 0].flip(-1).clone()
        return (await m.logits).clone()

    torch.testing.assert_close(lm.trace(p, edit), by_hand(model, tok, p, [(gate, "out", hand)]), atol=1e-5, rtol=0)


def test_routed_edit_equals_hand_written_hook(moe):
    lm, model, tok = moe

    async def double(m):
        o = await m.layers[0].mlp.routed
        o *= 2
        return (await m.logits).clone()

    experts = model.model.layers[0].mlp.experts
    for p in PROMPTS[:2]:
        ref = by_hand(model, tok, p, [(experts, "out", lambda mod, a, out: out * 2)])
        torch.testing.assert_close(lm.trace(p, double), ref, atol=1e-5, rtol=0)


def test_batched_mask_touches_only_its_invoke(moe):
    lm, _, _ = moe

    async def logits(m):
        return (await m.logits).clone()

    with lm.trace() as tr:
        a = tr.invoke(PROMPTS[0], mask_top)
        b = tr.invoke(PROMPTS[2], logits)
    torch.testing.assert_close(a.result, lm.trace(PROMPTS[0], mask_top), atol=1e-5, rtol=0)
    torch.testing.assert_close(b.result, lm.trace(PROMPTS[2], logits), atol=1e-5, rtol=0)


def test_per_expert_is_read_only(moe):
    lm, _, _ = moe

    async def write(m):
        e = await m.layers[0].mlp.per_expert
        m.layers[0].mlp.per_expert.replace(torch.zeros_like(e))

    with pytest.raises(ReplacementError, match="per_expert is read-only"):
        lm.trace(PROMPTS[0], write)


def test_generation_steps_see_the_router(moe):
    lm, model, tok = moe
    n = 4

    async def count(m):
        shapes = []
        async for _ in m.steps():
            r = await m.layers[0].mlp.router
            shapes.append(tuple(r.shape[:2]))
            r.scatter_(-1, r.argmax(-1, keepdim=True), float("-inf"))
        return shapes

    out = lm.generate(PROMPTS[0], count, max_new_tokens=n)
    n_prompt = len(tok(PROMPTS[0])["input_ids"])
    assert out.result == [(1, n_prompt)] + [(1, 1)] * (n - 1)
    gate = model.model.layers[0].mlp.gate

    def hand_mask(mod, args, out):
        logits = out[0].clone()
        logits.scatter_(-1, logits.argmax(-1, keepdim=True), float("-inf"))
        w, idx = route(mod, logits, out[1])
        return logits, w, idx

    handle = gate.register_forward_hook(hand_mask)
    try:
        enc = tok(PROMPTS[0], return_tensors="pt")
        ref = model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
    finally:
        handle.remove()
    assert out.tokens.tolist() == ref[0, enc["input_ids"].shape[1]:].tolist()


def test_dense_model_has_no_router():
    from asyncinterp.models.hf.bundled import tiny_llama
    model, tok = tiny_llama()
    lm = ai.LanguageModel(model, tok)
    with pytest.raises(ModulePathError, match="router"):
        lm.layers[0].mlp.router  # noqa: B018


def test_router_with_another_rule_is_a_loud_error():
    """A router that takes the top-k *before* the softmax (as GPT-OSS does): re-routing by softmax -> top-k would
    be wrong, so an edit of its logits raises instead of being ignored or mis-applied."""
    from asyncinterp.hooks.moe import MoEPointError
    model, tok = tiny_moe("mixtral")
    gate = model.model.layers[0].mlp.gate

    def forward(hidden_states, mod=gate):
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, mod.hidden_dim), mod.weight)
        top, idx = torch.topk(logits, mod.top_k, dim=-1)
        return logits, torch.sigmoid(top), idx            # not what softmax -> top-k gives

    gate.forward = forward
    lm = ai.LanguageModel(model, tok)

    async def read(m):
        return (await m.layers[0].mlp.router).clone()

    assert lm.trace(PROMPTS[0], read).shape[-1] == 4      # reading is fine
    with pytest.raises(MoEPointError, match="does not route by softmax"):
        lm.trace(PROMPTS[0], mask_top)
