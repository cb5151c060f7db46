"""Modules attached to a wrapped model (SAEs): their points fire when an intervention calls them."""

import pytest
import torch

import asyncinterp as ai
from docsnippets import python_blocks, run_page
from gc_helpers import settle_garbage


def test_attach_page_runs(capsys):
    assert len(python_blocks("attach.md")) >= 4
    ns = run_page("attach.md")
    out = capsys.readouterr().out
    assert "torch.Size([3, 16])" in out
    assert "<hook point transformer.h.1.resid_post>" in out and "torch.Size([1, 6, 64])" in out   # by hook name
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

    with model.trace() as tr:
        a = tr.invoke(x[:2], read_probe)
        b = tr.invoke(x[2:], read_probe)
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


class _NamedSAE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Linear(4, 8)
        self.act = torch.nn.ReLU()

    def forward(self, h):
        return self.act(self.encoder(h))


def test_attached_children_read_before_the_run_stay_per_invoke():
    """A child of an attached module read outside a run (and kept on that envoy) is still per invoke inside."""
    torch.manual_seed(2)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    sae = _NamedSAE()
    model = ai.wrap(net)
    model.attach("sae", sae)
    assert model.sae.encoder.path == "sae.encoder"      # read (and kept) outside any run

    async def read_encoder(m):
        pre = await ai.spawn(m.sae.encoder.output)
        m.sae(await m[1].output)
        return (await pre).clone()

    x = torch.randn(5, 4)
    with model.trace() as tr:
        a = tr.invoke(x[:2], read_encoder)
        b = tr.invoke(x[2:], read_encoder)
    torch.testing.assert_close(a.result, sae.encoder(net(x[:2])))
    torch.testing.assert_close(b.result, sae.encoder(net(x[2:])))


def test_attaching_under_a_standard_name_read_before_wins(gpt2_hf):
    """Attached modules come before standard names, also for a name that was already read (and kept)."""
    model = ai.wrap(gpt2_hf)
    assert model.embed.path == "transformer.wte"
    probe = torch.nn.Linear(4, 4)
    model.attach("embed", probe)
    assert model.embed.module is probe
    model.detach("embed")
    assert model.embed.path == "transformer.wte"
