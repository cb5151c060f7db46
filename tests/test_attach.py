"""Modules attached to a wrapped model (SAEs): their points fire when an intervention calls them."""

import pytest
import torch

import asyncinterp as ai
from docsnippets import python_blocks, run_page
from gc_helpers import settle_garbage


def test_attach_page_runs(capsys):
    assert len(python_blocks("attach.md")) >= 4
    ns = run_page("attach.md")
    assert "torch.Size([3, 16])" in capsys.readouterr().out
    net, sae = ns["net"], ns["sae"]
    assert not net._forward_hooks and not sae.encoder._forward_hooks and not sae.act._forward_hooks


def test_attached_points_per_invoke_and_errors():
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    probe = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    model = ai.wrap(net)
    model.attach("probe", probe)
    x = torch.randn(5, 4)

    async def read_probe(m):
        acts = await ai.spawn(m.probe[1].output)
        h = await m[1].output
        m.probe(h)
        return (await acts).clone()

    with model.trace() as run:
        a = run.invoke(x[:2], read_probe)
        b = run.invoke(x[2:], read_probe)
    # rows of a batch of 5 against those rows alone: float32 tolerances (BLAS may pick other kernels)
    torch.testing.assert_close(a.result, probe(net(x[:2])))
    torch.testing.assert_close(b.result, probe(net(x[2:])))

    with pytest.raises(ValueError, match="already"):
        model.attach("probe", probe)
    with pytest.raises(ValueError, match="already"):
        model.attach("forward", probe)
    model.detach("probe")
    with pytest.raises(ai.ModulePathError):
        model.probe


def test_attached_module_outside_a_run_and_no_cycles():
    import gc
    net = torch.nn.Sequential(torch.nn.Linear(4, 4))
    sae = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    model = ai.wrap(net)
    model.attach("sae", sae)
    x = torch.randn(2, 4)
    assert torch.equal(model.sae(x), sae(x))   # outside a run: a plain call

    async def splice(m):
        h = await m[0].output
        m[0].output = m.sae(h)
    model.trace(x, splice)
    settle_garbage()
    gc.disable()
    try:
        model.trace(x, splice)
        assert gc.collect() == 0
    finally:
        gc.enable()
