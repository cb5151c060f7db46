"""Gradients inside runs: autograd on real tensors, backward passes, gradient hook points."""

import pytest
import torch

import asyncinterp as ai
from conftest import MLP


@pytest.fixture
def net():
    torch.manual_seed(0)
    return MLP().eval()


def _x(rows=3, seed=1):
    torch.manual_seed(seed)
    return torch.randn(rows, 8)


def test_autograd_grad_inside_task_equals_torch(net):
    x = _x()
    model = ai.wrap(net)

    async def fn(m):
        h = await m.layers[2].output
        out = await m.output
        return torch.autograd.grad(out.sum(), h)[0]

    got = model.trace(x, fn)

    saved = {}
    handle = net.layers[2].register_forward_hook(lambda mod, a, o: saved.setdefault("h", o))
    out = net(x)
    handle.remove()
    want = torch.autograd.grad(out.sum(), saved["h"])[0]
    assert torch.equal(got, want)


def test_grad_point_equals_autograd(net):
    x = _x()
    model = ai.wrap(net)

    async def reader(m):
        return await m.layers[3].output.grad

    async def driver(m):
        out = await m.output
        await m.backward(out.pow(2).sum())

    with model.trace() as tr:
        inv = tr.invoke(x, reader, driver)
    got, _ = inv.result

    saved = {}
    handle = net.layers[3].register_forward_hook(lambda mod, a, o: saved.setdefault("h", o))
    out = net(x)
    handle.remove()
    want = torch.autograd.grad(out.pow(2).sum(), saved["h"])[0]
    assert torch.equal(got, want)
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in net.modules()) == 0


def test_zeroing_grad_changes_param_grads_like_a_hook(net):
    x = _x()
    model = ai.wrap(net)

    async def fn(m):
        g = await ai.spawn(m.layers[3].output.grad)
        out = await m.output
        await m.backward(out.sum())

    async def zero(m):
        g = await m.layers[3].output.grad
        g.zero_()

    net.zero_grad()
    with model.trace() as tr:
        tr.invoke(x, fn, zero)
    ours = {n: p.grad.clone() for n, p in net.named_parameters()}

    net.zero_grad()
    def fwd_hook(mod, a, o):
        o.register_hook(lambda g: torch.zeros_like(g))
    h = net.layers[3].register_forward_hook(fwd_hook)
    net(x).sum().backward()
    h.remove()
    theirs = {n: p.grad.clone() for n, p in net.named_parameters()}
    for n in ours:
        assert torch.equal(ours[n], theirs[n]), n
    assert torch.count_nonzero(ours["embed.weight"]) == 0
    assert torch.count_nonzero(ours["head.weight"]) > 0


def _hand_grads(net, x, layer, loss_fn=lambda out: out.sum(), grad_hook=None):
    """Run net with a hand-written forward hook capturing layer output (and optionally a tensor hook)."""
    saved = {}

    def fwd(mod, a, o):
        saved["h"] = o
        if grad_hook is not None:
            o.register_hook(grad_hook)
    h = net.layers[layer].register_forward_hook(fwd)
    out = net(x)
    h.remove()
    return saved, out


def test_replacing_grad_equals_hook_returning_it(net):
    x = _x()
    model = ai.wrap(net)
    fixed = torch.linspace(-1, 1, 16).expand(3, 16).contiguous()

    async def fn(m):
        await ai.spawn(replace(m))
        out = await m.output
        await m.backward(out.sum())

    async def replace(m):
        await m.layers[2].output.grad
        m.layers[2].output.grad = fixed

    net.zero_grad()
    model.trace(x, fn)
    ours = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    _, out = _hand_grads(net, x, 2, grad_hook=lambda g: fixed)
    out.sum().backward()
    for a, b in zip(ours, [p.grad for p in net.parameters()]):
        assert torch.equal(a, b)


def test_invokes_see_and_change_only_their_rows_of_the_grad(net):
    x1, x2 = _x(2, 1), _x(3, 2)
    model = ai.wrap(net)
    seen = {}

    async def driver(m):
        out = await m.output
        await m.backward(out.pow(2).sum())

    async def zero_mine(m):
        g = await m.layers[3].output.grad
        seen["a"] = g.clone()
        g.zero_()

    async def read_mine(m):
        seen["b"] = (await m.layers[3].output.grad).clone()

    net.zero_grad()
    with model.trace() as tr:
        tr.invoke(x1, zero_mine)
        tr.invoke(x2, read_mine)
        tr.invoke(None, driver)        # whole batch: starts the backward
    ours = [p.grad.clone() for p in net.parameters()]

    net.zero_grad()
    full = {}

    def hook(g):
        full["g"] = g.clone()
        g = g.clone()
        g[:2] = 0
        return g
    _, out = _hand_grads(net, torch.cat([x1, x2]), 3, grad_hook=hook)
    out.pow(2).sum().backward()
    assert torch.equal(seen["a"], full["g"][:2]) and torch.equal(seen["b"], full["g"][2:])
    for a, b in zip(ours, [p.grad for p in net.parameters()]):
        assert torch.equal(a, b)


def test_same_task_reads_activation_and_its_grad(net):
    """Attribution-style: activation x gradient for every layer, from one intervention."""
    x = _x()
    model = ai.wrap(net)

    async def attribute(m):
        acts, grads = [], []
        for layer in m.layers:
            acts.append(await layer.output)
            grads.append(await ai.spawn(layer.output.grad))
        out = await m.output
        await m.backward(out[:, 0].sum())
        return [(a * await g).sum().item() for a, g in zip(acts, grads)]

    got = model.trace(x, attribute)
    saved = []
    hs = [l.register_forward_hook(lambda mod, a, o: saved.append(o)) for l in net.layers]
    out = net(x)
    for h in hs:
        h.remove()
    grads = torch.autograd.grad(out[:, 0].sum(), saved)
    want = [(a * g).sum().item() for a, g in zip(saved, grads)]
    assert got == want


def test_input_grad_equals_autograd(net):
    x = _x()
    model = ai.wrap(net)

    async def reader(m):
        return await m.layers[1].input.grad

    async def driver(m):
        await m.backward((await m.output).sum())

    with model.trace() as tr:
        inv = tr.invoke(x, reader, driver)
    got = inv.result[0]
    saved = {}
    h = net.layers[1].register_forward_pre_hook(lambda mod, a: saved.update(x=a[0]))
    out = net(x)
    h.remove()
    assert torch.equal(got, torch.autograd.grad(out.sum(), saved["x"])[0])


def test_grad_point_after_forward_passed_is_out_of_order(net):
    model = ai.wrap(net)

    async def late(m):
        out = await m.output
        await m.layers[1].output.grad

    with pytest.raises(ai.OutOfOrderError, match="ai.spawn"):
        model.trace(_x(), late)


def test_grad_point_under_no_grad_fails_clearly(net):
    model = ai.wrap(net)

    async def reader(m):
        await m.layers[1].output.grad

    with torch.no_grad(), pytest.raises(RuntimeError, match="requires grad"):
        model.trace(_x(), reader)


def test_backward_outside_run_and_no_leftover_hooks(net):
    model = ai.wrap(net)
    calls = []

    async def reader(m):
        calls.append(await m.layers[1].output.grad)

    async def driver(m):
        out = await m.output
        await m.backward(out.sum(), retain_graph=True)
        return out

    with model.trace() as tr:
        inv = tr.invoke(_x(), reader, driver)
    out = inv.result[1]
    out.sum().backward()              # after the run: our tensor hooks are gone
    assert len(calls) == 1
    with pytest.raises(ai.NotInRunError):
        ai.backward(out.sum())


def test_grad_on_language_model_trace_equals_autograd():
    pytest.importorskip("asyncinterp.models.hf.language")
    from asyncinterp.models import tiny
    lm = tiny("llama")
    net = lm.module
    target = lm.token_id(" Paris") if len(lm.tokenizer) > 1000 else 5

    async def fn(m):
        g = await ai.spawn(m.layers[1].output.grad)      # standard names work too
        logits = await m.lm_head.output
        await m.backward(logits[0, -1, target])
        return await g

    got = lm.trace("The capital of France is", fn)
    ids = lm.tokenizer("The capital of France is", return_tensors="pt")
    saved = {}
    h = net.model.layers[1].register_forward_hook(lambda mod, a, o: saved.update(h=o))
    logits = net(**ids).logits
    h.remove()
    want = torch.autograd.grad(logits[0, -1, target], saved["h"])[0]
    assert torch.equal(got, want)


def test_gradients_page_runs(capsys):
    from docsnippets import python_blocks, run_page
    assert len(python_blocks("gradients.md")) >= 6
    ns = run_page("gradients.md")
    out = capsys.readouterr().out
    assert "torch.Size([3, 8])" in out and "tensor(0.)" in out and "already ran" in out
    assert len(ns["scores"]) == 4


# ------------------------------------------------ several backward passes through one forward
def _two_losses(net, x, layer=2):
    saved, out = _hand_grads(net, x, layer)
    w1 = torch.autograd.grad(out.sum(), saved["h"], retain_graph=True)[0]
    w2 = torch.autograd.grad(out.pow(2).sum(), saved["h"])[0]
    assert not torch.equal(w1, w2)
    return w1, w2


async def _two_backwards(m):
    out = await m.output
    await m.backward(out.sum(), retain_graph=True)
    await m.backward(out.pow(2).sum())


def test_two_backwards_one_task_awaiting_twice(net):
    x = _x()
    model = ai.wrap(net)
    w1, w2 = _two_losses(net, x)

    async def reader(m):
        a = await m.layers[2].output.grad
        b = await m.layers[2].output.grad
        return a, b

    with model.trace() as tr:
        inv = tr.invoke(x, reader, reader, _two_backwards)   # two tasks, each reads both
    (a, b), (c, d), _ = inv.result
    assert torch.equal(a, w1) and torch.equal(b, w2)
    assert torch.equal(c, w1) and torch.equal(d, w2)


def test_two_backwards_spawned_or_gathered_bind_to_successive_passes(net):
    """Was a silent wrong number: both sub-tasks bound to the first backward pass."""
    x = _x()
    model = ai.wrap(net)
    w1, w2 = _two_losses(net, x)

    async def spawned(m):
        g1 = await ai.spawn(m.layers[2].output.grad)
        g2 = await ai.spawn(m.layers[2].output.grad)
        await _two_backwards(m)
        return await g1, await g2

    async def gathered(m):
        both = await ai.spawn(ai.gather(m.layers[2].output.grad, m.layers[2].output.grad))
        await _two_backwards(m)
        return await both

    async def spawned_between(m):      # a sub-task spawned right before the second backward
        g1 = await ai.spawn(m.layers[2].output.grad)
        out = await m.output
        await m.backward(out.sum(), retain_graph=True)
        g2 = await ai.spawn(m.layers[2].output.grad)
        await m.backward(out.pow(2).sum())
        return await g1, await g2

    for fn in (spawned, gathered, spawned_between):
        a, b = model.trace(x, fn)
        assert torch.equal(a, w1) and torch.equal(b, w2), fn.__name__


def test_two_backwards_in_separate_traces(net):
    x = _x()
    model = ai.wrap(net)
    w1, w2 = _two_losses(net, x)

    async def one(m, loss_fn):
        g = await ai.spawn(m.layers[2].output.grad)
        await m.backward(loss_fn(await m.output))
        return await g

    assert torch.equal(model.trace(x, lambda m: one(m, lambda o: o.sum())), w1)
    assert torch.equal(model.trace(x, lambda m: one(m, lambda o: o.pow(2).sum())), w2)


def test_grad_await_for_a_computation_that_already_happened_is_loud(net):
    model = ai.wrap(net)

    async def fn(m):
        g1 = await ai.spawn(m.layers[2].output.grad)
        out = await m.output
        await m.backward(out.sum(), retain_graph=True)
        await g1
        await m.layers[2].output.grad      # the task's await #2: binds to the 2nd backward (never comes)

    with pytest.raises(ai.MissedHookPoint, match=r"await m\.backward\(loss\)"):
        model.trace(_x(), fn)


def test_grad_without_backward_names_backward(net):
    model = ai.wrap(net)

    async def reader(m):
        return await m.layers[2].output.grad

    with pytest.raises(ai.MissedHookPoint, match=r"start one inside the same run with `await m\.backward\(loss\)`"):
        model.trace(_x(), reader)


def test_missed_grad_point_hint_comes_from_the_scheduler(net):
    """When kernel/scheduler.py appends `getattr(trap, "hint", "")`, the hint is in the message without
    GradPoint.__await__ adding it (this test checks the scheduler path alone)."""
    from asyncinterp.hooks.grad import GradPoint
    model = ai.wrap(net)

    async def reader(m):
        # bypass GradPoint.__await__'s own augmentation: yield the trap as the scheduler sees it
        return await _RawAwait(m.layers[2].output.grad)

    with pytest.raises(ai.MissedHookPoint) as info:
        model.trace(_x(), reader)
    assert GradPoint.hint in str(info.value)


class _RawAwait:
    def __init__(self, trap):
        self.trap = trap

    def __await__(self):
        return (yield self.trap)


# ------------------------------------------------ ai.gradients: several points, one await
def test_gradients_equals_autograd_grad(net):
    x = _x()
    model = ai.wrap(net)

    async def fn(m):
        grads = ai.gradients(m.layers[1].output, m.layers[3].output, m.layers[3].input)
        out = await m.output
        return await grads.backward(out.pow(2).sum())

    net.zero_grad()
    got = model.trace(x, fn)
    assert all(p.grad is None for p in net.parameters())     # like torch.autograd.grad: nothing accumulated
    saved = {}
    hs = [net.layers[1].register_forward_hook(lambda mod, a, o: saved.update(h1=o)),
          net.layers[3].register_forward_hook(lambda mod, a, o: saved.update(h3=o)),
          net.layers[3].register_forward_pre_hook(lambda mod, a: saved.update(i3=a[0]))]
    out = net(x)
    for h in hs:
        h.remove()
    want = torch.autograd.grad(out.pow(2).sum(), [saved["h1"], saved["h3"], saved["i3"]])
    assert len(got) == 3
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_gradients_edit_and_invoke_rows(net):
    x1, x2 = _x(2, 1), _x(3, 2)
    model = ai.wrap(net)
    got = {}

    async def mine(m):
        grads = ai.gradients(m.layers[1].output, m.layers[3].output)
        out = await m.output
        got["a"] = await grads.backward(out.pow(2).sum(), edit={m.layers[3].output: lambda g: g.mul_(0.5)})

    async def other(m):
        await m.output

    with model.trace() as tr:
        tr.invoke(x1, mine)
        tr.invoke(x2, other)
    g1, g3 = got["a"]
    assert g1.shape[0] == 2 and g3.shape[0] == 2

    full = {}

    def hook(g):
        full["g3"] = g.clone()
        return g * 0.5
    saved = {}
    h1 = net.layers[1].register_forward_hook(lambda mod, a, o: saved.update(h1=o))
    s, out = _hand_grads(net, torch.cat([x1, x2]), 3, grad_hook=hook)
    h1.remove()
    (w1,) = torch.autograd.grad(out.pow(2).sum(), [saved["h1"]])
    # the returned layer-3 gradient is the one that reached it; layer 1's includes the edit
    # (the loss covers both invokes' rows; the edit applies to the whole gradient here because every row of
    # the hand-written run is edited, so compare only this invoke's rows where both agree)
    assert torch.equal(g3, full["g3"][:2])
    assert torch.allclose(g1, w1[:2])


def test_gradients_misuse_is_loud(net):
    model = ai.wrap(net)

    async def too_late(m):
        out = await m.output
        ai.gradients(m.layers[1].output)

    with pytest.raises(ai.OutOfOrderError):
        model.trace(_x(), too_late)

    async def inside_the_firing(m):
        grads = ai.gradients(m.layers[1].output)
        h = await m.layers[1].output
        await grads.backward(h.sum())

    with pytest.raises(RuntimeError, match="firing now"):
        model.trace(_x(), inside_the_firing)

    async def not_in_graph(m):
        grads = ai.gradients(m.layers[3].output)
        h = await m.layers[1].output
        await m.output
        await grads.backward(h.sum())

    with pytest.raises(ValueError, match="does not depend on layers.3.output"):
        model.trace(_x(), not_in_graph)

    async def twice(m):
        grads = ai.gradients(m.layers[1].output)
        out = await m.output
        await grads.backward(out.sum(), retain_graph=True)
        await grads.backward(out.sum())

    with pytest.raises(RuntimeError, match="already called"):
        model.trace(_x(), twice)

    async def bad_edit(m):
        grads = ai.gradients(m.layers[1].output)
        out = await m.output
        await grads.backward(out.sum(), edit={m.layers[2].output: lambda g: g})

    with pytest.raises(ValueError, match="not among the points"):
        model.trace(_x(), bad_edit)

    with pytest.raises(ai.NotInRunError):
        ai.gradients(model.layers[1].output)
