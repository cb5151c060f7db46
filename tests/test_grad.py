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

    with model.trace() as run:
        inv = run.invoke(x, reader, driver)
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
    with model.trace() as run:
        run.invoke(x, fn, zero)
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
