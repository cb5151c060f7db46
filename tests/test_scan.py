"""Scan: shapes and dtypes of hook points from fake tensors equal those of a real run."""

import pytest
import torch

import asyncinterp as ai
from conftest import MLP, hook_count


def _real_shapes(net, x, names, inputs=False):
    shapes = {}
    handles = []
    for name, mod in net.named_modules():
        if name in names:
            handles.append(mod.register_forward_hook(
                lambda m, a, o, name=name: shapes.update({f"{name}.output": (o.shape, o.dtype)})))
            if inputs:
                handles.append(mod.register_forward_pre_hook(
                    lambda m, a, name=name: shapes.update({f"{name}.input": (a[0].shape, a[0].dtype)})))
    net(x)
    for h in handles:
        h.remove()
    return shapes


def test_scan_shapes_equal_real_shapes_mlp():
    torch.manual_seed(0)
    net = MLP().eval()
    model = ai.wrap(net)
    x = torch.randn(5, 8)
    shapes = model.scan(x, "layers.*", inputs=True)
    want = _real_shapes(net, x, {f"layers.{i}" for i in range(6)}, inputs=True)
    assert set(shapes) == set(want)
    for k, (shape, dtype) in want.items():
        assert shapes[k].shape == shape and shapes[k].dtype == dtype
    assert shapes.layers[0].output.shape == (5, 16)
    assert "layers.0.output" in repr(shapes)
    assert hook_count(net) == 0


def test_scan_computes_nothing():
    calls = []

    class Spy(torch.nn.Module):
        def forward(self, x):
            calls.append(type(x).__name__)
            return x * 2

    model = ai.wrap(torch.nn.Sequential(torch.nn.Linear(4, 4), Spy()))
    shapes = model.scan(torch.randn(2, 4))
    assert calls == ["FakeTensor"]
    assert shapes["1.output"].shape == (2, 4)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_scan_hf_models_real_and_meta(arch, gpt2_hf, llama_hf):
    net = gpt2_hf if arch == "gpt2" else llama_hf
    ids = torch.randint(0, 100, (2, 7))
    layers = "transformer.h.*" if arch == "gpt2" else "model.layers.*"
    model = ai.wrap(net)
    shapes = model.scan(ids, layers)
    real = ai.cache(model, ids, layers)
    assert list(shapes) == real.keys()
    for k in real.keys():
        assert shapes[k].shape == real[k].shape and shapes[k].dtype == real[k].dtype

    # the same architecture built on the meta device: no weights at all
    with torch.device("meta"):
        meta_net = type(net)(net.config).eval()
    assert next(meta_net.parameters()).is_meta
    meta_shapes = ai.wrap(meta_net).scan(ids, layers)
    assert [(k, v.shape, v.dtype) for k, v in meta_shapes.items()] == \
           [(k, v.shape, v.dtype) for k, v in shapes.items()]


def test_scan_runs_interventions_with_fake_tensors():
    torch.manual_seed(0)
    net = MLP().eval()
    model = ai.wrap(net)

    async def probe(m):
        h = await m.layers[2].output
        m.layers[2].output = torch.zeros(h.shape)     # a replacement of the right shape
        logits = await m.output
        return tuple(h.shape), tuple(logits.shape), type(h).__name__

    assert model.scan(torch.randn(3, 8), probe) == ((3, 16), (3, 4), "FakeTensor")

    async def wrong(m):
        await m.layers[2].output
        m.layers[2].output = torch.zeros(3, 5)

    with pytest.raises(ai.ReplacementError, match="shape"):
        model.scan(torch.randn(3, 8), wrong)


def test_scan_is_a_run_of_the_models_own_class_and_sees_edits():
    from asyncinterp.tools.scan import FakeExecution, ScanEngine, scan_run
    torch.manual_seed(0)
    net = MLP().eval()
    model = ai.wrap(net)
    trace = scan_run(model)
    assert isinstance(trace.engine, ScanEngine) and trace.engine.engine is model.engine("trace")
    trace.invoke(torch.randn(2, 8))
    trace.run()
    # the scan's execution wraps the very run class the model's own engine makes
    assert isinstance(trace.execution, FakeExecution)
    assert type(trace.execution.run) is type(model.engine("trace").start(ai.Job()))

    async def ablate(m):
        h = await m.layers[2].output
        h[:] = 0

    async def probe(m):
        return type(await m.layers[2].output).__name__

    assert model.edit(ablate).scan(torch.randn(2, 8), probe) == "FakeTensor"
    assert model.trace(torch.randn(2, 8), probe) == "Tensor"   # the real run's class is untouched
    assert hook_count(net) == 0


def test_shapes_attribute_access():
    model = ai.wrap(MLP().eval())
    shapes = model.scan(torch.randn(2, 8), "layers.*")
    assert shapes.layers[3].output == shapes["layers.3.output"]
    with pytest.raises(AttributeError, match="the scan has nothing under 'layers.9'"):
        shapes.layers[9]


def test_scan_language_model_prompt():
    pytest.importorskip("asyncinterp.models.hf.language")
    from asyncinterp.models import tiny
    lm = tiny("llama")
    shapes = lm.scan(["Hello world", "A much longer prompt here"], "model.layers.*")
    real = lm.trace(["Hello world", "A much longer prompt here"], ai.Cache("model.layers.*"))
    for k in real.keys():
        assert shapes[k].shape == real[k].shape


def test_scan_page_runs(capsys):
    from docsnippets import python_blocks, run_page
    assert len(python_blocks("scan.md")) >= 4
    run_page("scan.md")
    out = capsys.readouterr().out
    assert "transformer.h.0.output" in out and "torch.Size([2, 7, 32])" in out
    assert "meta" in out and "((2, 7, 32), (2, 7, 101))" in out and "shape (2, 32)" in out
