"""Reads, writes, invokes and control on real torch models, compared with hand-written hooks."""

import pytest
import torch

import asyncinterp as ai
from conftest import hook_count


def reference_read(module, point_module, x, edit=None):
    """Run ``module(x)`` with a hand-written hook on ``point_module``; optional in-place edit."""
    box = {}

    def hook(mod, args, out):
        box["value"] = out.clone()
        if edit is not None:
            edit(out)
    h = point_module.register_forward_hook(hook)
    try:
        out = module(x)
    finally:
        h.remove()
    return box["value"], out


def test_read_equals_hand_written_hook(mlp):
    x = torch.randn(3, 8)
    model = ai.wrap(mlp)

    async def read(m):
        return (await m.layers[2].output).clone()

    ref, _ = reference_read(mlp, mlp.layers[2], x)
    assert torch.equal(model.trace(x, read), ref)
    assert hook_count(mlp) == 0


def test_in_place_edit_changes_what_the_model_computes(mlp):
    x = torch.randn(3, 8)
    model = ai.wrap(mlp)

    async def edit(m):
        h = await m.layers[1].output
        h[:, :4] = 0
        return await m.output

    def ref_edit(out):
        out[:, :4] = 0
    _, ref_out = reference_read(mlp, mlp.layers[1], x, ref_edit)
    got = model.trace(x, edit)
    assert torch.equal(got, ref_out)
    assert not torch.equal(got, mlp(x))


def test_replace_output_by_assignment_and_by_method(mlp):
    x = torch.randn(2, 8)
    model = ai.wrap(mlp)
    new = torch.ones(2, 16)

    async def assign(m):
        await m.layers[3].output
        m.layers[3].output = new
        return await m.output

    async def method(m):
        await m.layers[3].output
        m.layers[3].output.replace(new)
        return await m.output

    h = mlp.layers[3].register_forward_hook(lambda mod, a, o: new)
    ref = mlp(x)
    h.remove()
    assert torch.equal(model.trace(x, assign), ref)
    assert torch.equal(model.trace(x, method), ref)


def test_a_later_intervention_on_the_same_point_sees_an_earlier_ones_replacement(mlp):
    """Two interventions of one invoke wait on one point: the first replaces it, the second reads the
    replacement (the kernel's view after the host replaced the firing's entry), as two hand-written hooks
    registered in that order do."""
    x = torch.randn(2, 8)
    model = ai.wrap(mlp)
    new = torch.full((2, 16), 0.5)

    async def writer(m):
        await m.layers[3].output
        m.layers[3].output = new

    async def reader(m):
        seen = (await m.layers[3].output).clone()
        return seen, await m.output

    box = {}
    h1 = mlp.layers[3].register_forward_hook(lambda mod, a, o: new)
    h2 = mlp.layers[3].register_forward_hook(lambda mod, a, o: box.setdefault("seen", o.clone()))
    try:
        ref_out = mlp(x)
    finally:
        h1.remove()
        h2.remove()
    _, (seen, out) = model.trace(x, writer, reader)
    assert torch.equal(seen, box["seen"]) and torch.equal(seen, new)
    assert torch.equal(out, ref_out)


def test_replace_input(mlp):
    x = torch.randn(2, 8)
    model = ai.wrap(mlp)

    async def fn(m):
        inp = await m.layers[0].input
        m.layers[0].input = inp * 2
        return await m.output

    h = mlp.layers[0].register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    ref = mlp(x)
    h.remove()
    assert torch.equal(model.trace(x, fn), ref)


def test_inputs_point_gives_args_and_kwargs(gpt2_hf):
    ids = torch.randint(0, 100, (1, 5))
    model = ai.wrap(gpt2_hf)

    async def fn(m):
        args, kwargs = await m.transformer.h[1].inputs
        return args[0].shape, sorted(kwargs)

    shape, keys = model.trace(ids, fn)
    assert shape == (1, 5, 32)
    assert isinstance(keys, list)


def test_wrong_shape_replacement_raises_at_the_users_line(mlp):
    model = ai.wrap(mlp)

    async def bad(m):
        await m.layers[0].output
        m.layers[0].output = torch.zeros(5, 5)  # the offending line

    with pytest.raises(ai.ReplacementError) as info:
        model.trace(torch.randn(2, 8), bad)
    msg = str(info.value)
    assert "layers.0.output" in msg and "(5, 5)" in msg and "(2, 16)" in msg
    tb = info.tb
    lines = []
    while tb is not None:
        lines.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert "bad" in lines
    assert hook_count(mlp) == 0


def test_skip_module_with_given_output(mlp):
    x = torch.randn(2, 8)
    model = ai.wrap(mlp)
    calls = []
    h = mlp.layers[2][0].register_forward_pre_hook(lambda mod, a: calls.append(1))

    async def fn(m):
        m.layers[2].skip(torch.zeros(2, 16))
        return await m.output

    got = model.trace(x, fn)
    h.remove()
    assert calls == []  # layer 2's inner Linear never ran
    ref_h = mlp.layers[2].register_forward_hook(lambda mod, a, o: torch.zeros(2, 16))
    ref = mlp(x)
    ref_h.remove()
    assert torch.equal(got, ref)
    assert "forward" not in mlp.layers[2].__dict__


def test_stop_returns_result_and_skips_the_rest(mlp):
    model = ai.wrap(mlp)
    ran = []
    h = mlp.head.register_forward_pre_hook(lambda mod, a: ran.append(1))

    async def fn(m):
        h1 = await m.layers[1].output
        m.stop()
        return h1.sum().item()

    result = model.trace(torch.randn(2, 8), fn)
    h.remove()
    assert isinstance(result, float) and ran == []
    assert hook_count(mlp) == 0


def test_adhoc_call_does_not_fire_hook_points(mlp):
    model = ai.wrap(mlp)
    x = torch.randn(2, 8)

    async def lens(m):
        h = await m.layers[2].output
        early = m.head(h)         # logit-lens style ad-hoc call: no hook point fires
        final = await m.head.output
        return early, final

    early, final = model.trace(x, lens)
    with torch.no_grad():
        h = mlp.embed(x)
        for layer in mlp.layers[:3]:
            h = layer(h)
        assert torch.allclose(early, mlp.head(h))
    assert torch.equal(final, mlp(x))


def test_out_of_order_error_names_both_points_and_line(mlp):
    model = ai.wrap(mlp)

    async def backwards(m):
        await m.layers[4].output
        await m.layers[1].output

    for _ in range(3):  # run 1 records the order live; run 2 looks it up; run 3 reads the places cached on the points
        with pytest.raises(ai.OutOfOrderError) as info:
            model.trace(torch.randn(1, 8), backwards)
        msg = str(info.value)
        assert "layers.1.output" in msg and "layers.4.output" in msg and "test_core.py" in msg
    assert hook_count(mlp) == 0


def test_missed_point_error(mlp):
    model = ai.wrap(mlp)

    async def waits_twice(m):
        await m.head.output
        await m.head.output  # head runs once

    with pytest.raises(ai.MissedHookPoint) as info:
        model.trace(torch.randn(1, 8), waits_twice)
    assert "head.output" in str(info.value) and "test_core.py" in str(info.value)


def test_several_failing_interventions_raise_an_exception_group(mlp):
    model = ai.wrap(mlp)

    async def boom1(m):
        await m.layers[0].output
        raise KeyError("one")

    async def boom2(m):
        await m.layers[0].output
        raise ValueError("two")

    with pytest.raises(ExceptionGroup) as info:
        with model.trace() as tr:
            tr.invoke(torch.randn(1, 8), boom1)
            tr.invoke(torch.randn(1, 8), boom2)
    types = sorted(type(e).__name__ for e in info.value.exceptions)
    assert types == ["KeyError", "ValueError"]
    assert hook_count(mlp) == 0


def test_intervention_error_keeps_type_and_gets_hook_point_note(mlp):
    model = ai.wrap(mlp)

    async def fails(m):
        await m.layers[2].output
        raise ZeroDivisionError("user bug")

    with pytest.raises(ZeroDivisionError) as info:
        model.trace(torch.randn(1, 8), fails)
    assert any("layers.2.output" in n for n in info.value.__notes__)


def test_foreign_await_is_refused(mlp):
    import asyncio
    model = ai.wrap(mlp)

    async def sleeps(m):
        await m.layers[0].output
        await asyncio.sleep(0.01)

    with pytest.raises(ai.ForeignAwaitError, match="in_loop"):
        model.trace(torch.randn(1, 8), sleeps)


def test_invokes_different_batch_sizes_and_whole_batch(mlp):
    model = ai.wrap(mlp)
    xa, xb = torch.randn(2, 8), torch.randn(3, 8)
    full = torch.cat([xa, xb])
    ref, _ = reference_read(mlp, mlp.layers[3], full)

    async def read(m):
        return (await m.layers[3].output).clone()

    async def zero_mine(m):
        h = await m.layers[3].output
        h[:] = 0
        return (await m.output).clone()

    with model.trace() as tr:
        a = tr.invoke(xa, read)
        b = tr.invoke(xb, zero_mine)
        whole = tr.invoke(read)  # no input: sees the whole batch
    assert torch.equal(a.result, ref[:2])
    assert torch.equal(whole.result[:2], ref[:2])  # invoke 1 ran after invoke 0; both see the pre-edit rows 0-1
    assert torch.equal(whole.result[2:], torch.zeros(3, 16))  # whole-batch invoke runs after invoke 1's edit
    def zero_rows(out):
        out[2:] = 0
    _, ref_out = reference_read(mlp, mlp.layers[3], full, zero_rows)
    assert torch.equal(b.result, ref_out[2:])


def test_replacement_touches_only_own_rows(mlp):
    model = ai.wrap(mlp)
    xa, xb = torch.randn(2, 8), torch.randn(2, 8)

    async def replace_mine(m):
        await m.layers[2].output
        m.layers[2].output = torch.full((2, 16), 0.5)
        return await m.output

    async def out(m):
        return await m.output

    with model.trace() as tr:
        a = tr.invoke(xa, replace_mine)
        b = tr.invoke(xb, out)
    assert torch.allclose(b.result, mlp(xb), atol=1e-6)
    h = mlp.layers[2].register_forward_hook(lambda mod, a_, o: torch.full((2, 16), 0.5))
    ref = mlp(xa)
    h.remove()
    assert torch.allclose(a.result, ref, atol=1e-6)


def test_share_value_from_invoke_a_to_b_at_same_point(mlp):
    model = ai.wrap(mlp)
    xa, xb = torch.randn(1, 8), torch.randn(1, 8)
    clean = ai.Future()

    async def patch(m):  # added first, so resumed first: it must wait for record
        h = await m.layers[2].output
        h[:] = await clean
        return (await m.output).clone()

    async def record(m):
        clean.set_result((await m.layers[2].output).clone())

    with model.trace() as tr:
        p = tr.invoke(xb, patch)
        tr.invoke(xa, record)
    ref_h, _ = reference_read(mlp, mlp.layers[2], xa)
    h = mlp.layers[2].register_forward_hook(lambda mod, a_, o: ref_h)
    ref = mlp(xb)
    h.remove()
    assert torch.allclose(p.result, ref, atol=1e-6)


def test_gather_two_points(gpt2_hf):
    model = ai.wrap(gpt2_hf)
    ids = torch.randint(0, 100, (1, 6))
    block = gpt2_hf.transformer.h[1]

    async def both(m):
        mlp, attn = await ai.gather(m.transformer.h[1].mlp.output, m.transformer.h[1].attn.output)
        return mlp.clone(), attn[0].clone()

    mlp_out, attn_out = model.trace(ids, both)
    box = {}
    h1 = block.mlp.register_forward_hook(lambda mod, a, o: box.update(mlp=o.clone()))
    h2 = block.attn.register_forward_hook(lambda mod, a, o: box.update(attn=o[0].clone()))
    gpt2_hf(ids)
    h1.remove(), h2.remove()
    assert torch.equal(mlp_out, box["mlp"]) and torch.equal(attn_out, box["attn"])


def test_await_inside_a_module_then_its_parent(llama_hf):
    # a task resumed inside layer 1 (at its mlp) awaits layer 1's own output:
    # the hook is added while layer 1 runs, and must still fire.
    model = ai.wrap(llama_hf)
    ids = torch.randint(0, 100, (1, 5))

    async def fn(m):
        await m.model.layers[1].mlp.output
        return (await m.model.layers[1].output).clone()

    box = {}
    h = llama_hf.model.layers[1].register_forward_hook(lambda mod, a, o: box.update(v=o.clone()))
    llama_hf(ids)
    h.remove()
    assert torch.equal(model.trace(ids, fn), box["v"])


def test_model_error_closes_tasks_and_removes_hooks(mlp):
    model = ai.wrap(mlp)
    closed = []

    async def waiting(m):
        try:
            await m.head.output
        finally:
            closed.append(True)

    def explode(mod, args):
        raise RuntimeError("model broke")
    h = mlp.layers[3].register_forward_pre_hook(explode)
    with pytest.raises(RuntimeError, match="model broke"):
        model.trace(torch.randn(1, 8), waiting)
    h.remove()
    assert closed == [True]
    assert hook_count(mlp) == 0


def test_shared_module_called_twice_is_awaited_twice():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(self.lin(x))

    net = Twice()
    model = ai.wrap(net)
    x = torch.randn(1, 4)

    async def fn(m):
        first = (await m.lin.output).clone()
        second = await m.lin.output
        return first, second.clone()

    first, second = model.trace(x, fn)
    assert torch.equal(first, lin(x)) and torch.equal(second, lin(lin(x)))


def test_custom_hook_point_descriptor():
    attn = torch.nn.Linear(8, 8)

    class HeadsEnvoy(ai.Envoy):
        heads = ai.point(base="output",
                         read=lambda out: out.view(*out.shape[:-1], 2, 4),
                         write=lambda new, out: new.reshape(out.shape))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = attn

        def forward(self, x):
            return self.attn(x) * 2

    model = ai.wrap(Net(), envoys={torch.nn.Linear: HeadsEnvoy})
    x = torch.randn(3, 8)

    async def zero_head1(m):
        heads = await m.attn.heads
        assert heads.shape == (3, 2, 4)
        heads[:, 1] = 0          # in place, through the view
        return await m.output

    async def replace_heads(m):
        heads = await m.attn.heads
        m.attn.heads = torch.ones_like(heads)
        return await m.output

    ref = attn(x).detach().clone()
    ref[:, 4:] = 0
    assert torch.allclose(model.trace(x, zero_head1), ref * 2)
    assert torch.equal(model.trace(x, replace_heads), torch.full((3, 8), 2.0))


def test_wrap_adds_nothing_to_the_module(mlp):
    before = {k: v for k, v in mlp.__dict__.items()}
    model = ai.wrap(mlp)
    _ = model.layers[2].output
    assert hook_count(mlp) == 0
    assert set(mlp.__dict__) == set(before)


def test_spawned_points_report_the_users_line_and_tracebacks_hide_the_scheduler():
    import traceback
    net = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)])
    model = ai.wrap(net)
    x = torch.randn(2, 4)

    async def late_spawn(m):
        await m[2].output
        h = await ai.spawn(m[1].output)   # the line the error must name
        return await h

    with pytest.raises(ai.OutOfOrderError) as info:
        model.trace(x, late_spawn)
    line = late_spawn.__code__.co_firstlineno + 2
    assert f"{__file__}:{line}" in str(info.value)
    assert "<unknown line>" not in str(info.value)

    async def fails(m):
        await m[1].output
        raise ValueError("boom")

    with pytest.raises(ValueError) as info:
        model.trace(x, fails)
    frames = [f.filename for f in traceback.extract_tb(info.value.__traceback__)]
    assert not any("/asyncinterp/kernel/" in f for f in frames), frames
    assert frames[-1] == __file__


def test_several_failures_including_a_base_exception_are_grouped():
    class Stop(BaseException):
        pass

    model = ai.wrap(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)))

    async def raises_base(m):
        await m[0].output
        raise Stop()

    async def raises_plain(m):
        await m[0].output
        raise ValueError("plain")

    with pytest.raises(BaseExceptionGroup) as info:
        with model.trace() as tr:
            tr.invoke(torch.randn(1, 2), raises_base)
            tr.invoke(torch.randn(1, 2), raises_plain)
    assert {type(e) for e in info.value.exceptions} == {Stop, ValueError}
