"""Persistent edits: equal hand-written hooks, compose with runs, removal restores exact outputs."""

import pytest
import torch

import asyncinterp as ai
from conftest import MLP, hook_count


@pytest.fixture
def net():
    torch.manual_seed(0)
    return MLP().eval()


async def zero_layer2(m):
    h = await m.layers[2].output
    h[:, :4] = 0


async def double_layer4(m):
    h = await m.layers[4].output
    m.layers[4].output = h * 2


def _hooked(net, x, layer2=True, layer4=False, extra=None):
    handles = []
    if layer2:
        handles.append(net.layers[2].register_forward_hook(lambda m, a, o: (o[:, :4].zero_(), None)[1]))
    if layer4:
        handles.append(net.layers[4].register_forward_hook(lambda m, a, o: o * 2))
    if extra:
        handles.append(extra())
    out = net(x)
    for h in handles:
        h.remove()
    return out


def test_edit_equals_hooks_and_original_unchanged(net):
    x = torch.randn(3, 8)
    model = ai.wrap(net)
    plain = model.trace(x)
    edited = model.edit(zero_layer2)
    assert torch.equal(edited.trace(x), _hooked(net, x))
    assert torch.equal(edited.trace(x), _hooked(net, x))      # every later run
    assert torch.equal(model.trace(x), plain)                 # original wrapper not edited
    assert model.edits == () and edited.edits == (zero_layer2,)
    both = edited.edit(double_layer4)
    assert torch.equal(both.trace(x), _hooked(net, x, layer4=True))
    assert hook_count(net) == 0


def test_edit_composes_with_run_interventions(net):
    x = torch.randn(3, 8)
    edited = ai.wrap(net).edit(zero_layer2)

    async def read_and_add(m):
        seen = (await m.layers[2].output).clone()
        h = await m.layers[3].output
        h += 1
        return seen, await m.output

    seen, out = edited.trace(x, read_and_add)
    assert torch.all(seen[:, :4] == 0)                          # the run sees the edited model
    want = _hooked(net, x, extra=lambda: net.layers[3].register_forward_hook(lambda m, a, o: o + 1))
    assert torch.equal(out, want)


def test_edit_applies_to_every_invoke_row(net):
    x1, x2 = torch.randn(2, 8), torch.randn(1, 8)
    edited = ai.wrap(net).edit(zero_layer2)

    async def out(m):
        return await m.output

    with edited.trace() as tr:
        a = tr.invoke(x1, out)
        b = tr.invoke(x2, out)
    full = _hooked(net, torch.cat([x1, x2]))
    assert torch.equal(a.result, full[:2]) and torch.equal(b.result, full[2:])


def test_inplace_edit_and_removal_restores_exact_output(net):
    x = torch.randn(3, 8)
    model = ai.wrap(net)
    before = model.trace(x)
    assert model.edit(zero_layer2, inplace=True) is model
    model.edit(double_layer4, inplace=True)
    assert torch.equal(model.trace(x), _hooked(net, x, layer4=True))
    model.remove_edits(double_layer4)
    assert torch.equal(model.trace(x), _hooked(net, x))
    model.remove_edits()
    assert torch.equal(model.trace(x), before)
    with pytest.raises(ValueError, match="not an edit"):
        model.remove_edits(zero_layer2)
    with pytest.raises(TypeError, match="async def"):
        model.edit(lambda m: None)


def test_edit_failure_is_reported(net):
    async def broken(m):
        await m.layers[2].output
        raise KeyError("boom")

    edited = ai.wrap(net).edit(broken)
    with pytest.raises(KeyError, match="boom"):
        edited.trace(torch.randn(1, 8))
    assert hook_count(net) == 0


def test_edit_every_generation_step_and_clone_keeps_lm_state():
    pytest.importorskip("asyncinterp.models.hf.language")
    from asyncinterp.models import tiny
    lm = tiny("llama")
    net = lm.module
    torch.manual_seed(3)
    vec = torch.randn(net.config.hidden_size) * 3

    async def steer(m):
        h = await m.model.layers[0].output
        h += vec

    steps = []

    async def count(m):
        async for step in m.steps():
            await m.logits
            steps.append(step)

    edited = lm.edit(steer)
    assert edited.tokenizer is lm.tokenizer
    gen = edited.generate("Hello there", count, max_new_tokens=4)
    assert steps == [0, 1, 2, 3]

    handle = net.model.layers[0].register_forward_hook(lambda m, a, o: o + vec)
    try:
        want = lm.generate("Hello there", max_new_tokens=4)
    finally:
        handle.remove()
    assert torch.equal(gen.tokens, want.tokens)
    assert hook_count(net) == 0


def test_edits_page_runs(capsys):
    pytest.importorskip("asyncinterp.models.hf.language")
    from docsnippets import python_blocks, run_page
    assert len(python_blocks("edits.md")) >= 5
    ns = run_page("edits.md")
    out = capsys.readouterr().out
    assert "0.0\nTrue\n" in out and "()" in out
    assert ns["model"].edits == ()


def test_edit_rejects_non_interventions_with_edit_message(net):
    model = ai.wrap(net)
    coro = zero_layer2(model)                   # a coroutine object, not the function
    with pytest.raises(TypeError, match="model.edit expects"):
        model.edit(coro)
    coro.close()
    with pytest.raises(TypeError, match="model.edit expects"):
        model.edit(3)
    with pytest.raises(TypeError, match="plain function"):
        model.edit(lambda m: zero_layer2(m))    # allowed in a trace, not as an edit


def test_edited_copy_keeps_per_model_aliases(net):
    from asyncinterp.hooks.aliases import aliases_of, set_alias
    model = ai.wrap(net)
    set_alias(model, "final_norm", "layers.5")
    edited = model.edit(zero_layer2)
    assert aliases_of(edited) == {"final_norm": "layers.5"}
    assert edited.final_norm.path == "layers.5" and edited.final_norm.root is edited
    set_alias(edited, "final_norm", "layers.4")  # the copy's aliases are its own
    assert model.final_norm.path == "layers.5" and edited.final_norm.path == "layers.4"


def test_edited_copy_has_its_own_envoys_for_names_read_before(net):
    """Child envoys read on the original (and kept on it) do not leak into the copy's tree."""
    model = ai.wrap(net)
    original = model.layers[2]
    edited = model.edit(zero_layer2)
    assert edited.layers is not model.layers and edited.layers.root is edited
    assert edited.layers is edited.child("layers")      # one envoy per path in the copy's tree
    assert edited.layers[2] is not original and edited.layers[2].root is edited
    assert model.layers[2] is original
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))

    async def read2(m):
        return (await m.layers[2].output).clone()

    assert torch.count_nonzero(edited.trace(x, read2)[:, :4]) == 0      # the copy's edit runs
    assert torch.count_nonzero(model.trace(x, read2)[:, :4]) > 0        # the original has none
