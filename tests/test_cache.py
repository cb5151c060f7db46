"""Activation cache: equals hand-written hooks; filters, keys, steps, options."""

import pytest
import torch

import asyncinterp as ai
from asyncinterp.tools.cache import Cache, select
from conftest import MLP, hook_count


@pytest.fixture
def net():
    torch.manual_seed(0)
    return MLP().eval()


def _hooks_record(net, names, inputs=False):
    saved = {}
    handles = []
    for name, mod in net.named_modules():
        if name in names:
            def out_hook(m, a, o, name=name):
                saved.setdefault(f"{name}.output", []).append(o.detach())
            handles.append(mod.register_forward_hook(out_hook))
            if inputs:
                def in_hook(m, a, name=name):
                    saved.setdefault(f"{name}.input", []).append(a[0].detach())
                handles.append(mod.register_forward_pre_hook(in_hook))
    return saved, handles


def test_cache_equals_hand_written_hooks(net):
    x = torch.randn(3, 8)
    model = ai.wrap(net)
    c = ai.cache(model, x, "layers.*", inputs=True)
    names = [f"layers.{i}" for i in range(6)]
    saved, handles = _hooks_record(net, names, inputs=True)
    net(x)
    for h in handles:
        h.remove()
    assert set(c.keys()) == set(saved)
    for k, (v,) in saved.items():
        assert torch.equal(c[k], v)
    assert torch.equal(c.layers[2].output, saved["layers.2.output"][0])
    assert torch.equal(c["layers.2"].input, saved["layers.2.input"][0])
    assert hook_count(net) == 0


def test_filters(net):
    model = ai.wrap(net)
    paths = lambda spec: [e.path for e in select(model, spec)]
    assert paths("layers.*") == [f"layers.{i}" for i in range(6)]
    assert paths("layers.**") == [p for p, _ in net.named_modules() if p.startswith("layers.")]
    assert paths(["embed", "head"]) == ["embed", "head"]
    assert paths([model.layers[1], "head"]) == ["layers.1", "head"]
    assert paths(lambda p, m: isinstance(m, torch.nn.Tanh)) == [f"layers.{i}.1" for i in range(6)]
    assert "" not in paths(None) and len(paths(None)) == len(list(net.modules())) - 1
    with pytest.raises(ValueError, match="do not exist"):
        select(model, ["layerz.1"])


def test_cache_in_invokes_sees_own_rows_and_composes(net):
    x1, x2 = torch.randn(2, 8), torch.randn(3, 8)
    model = ai.wrap(net)
    c1, c2 = Cache(["layers.4"]), Cache(["layers.4"])

    async def ablate(m):
        h = await m.layers[1].output
        h[:] = 0

    with model.trace() as tr:
        tr.invoke(x1, c1, ablate)
        tr.invoke(x2, c2)
    full = {}
    h1 = net.layers[1].register_forward_hook(lambda m, a, o: (o[:2].zero_(), None)[1])
    h4 = net.layers[4].register_forward_hook(lambda m, a, o: full.setdefault("o", o.detach()))
    net(torch.cat([x1, x2]))
    h1.remove(); h4.remove()
    assert torch.equal(c1.layers[4].output, full["o"][:2])
    assert torch.equal(c2.layers[4].output, full["o"][2:])


def test_detach_device_clone(net):
    x = torch.randn(2, 8, requires_grad=True)
    model = ai.wrap(net)
    c = ai.cache(model, x, ["layers.0"], detach=False)
    assert c.layers[0].output.requires_grad
    c = ai.cache(model, x, ["layers.0"], device="cpu", clone=True)
    assert not c.layers[0].output.requires_grad
    assert "layers.0.output" in repr(c)


def test_repeated_calls_give_lists_and_steps(net):
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = net

        def forward(self, x):
            return self.inner(self.inner(x[:, :8]).repeat(1, 2))

    model = ai.wrap(Twice())
    x = torch.randn(2, 8)
    c = ai.cache(model, x, ["inner.head"])
    vals = c["inner.head.output"]
    assert isinstance(vals, list) and len(vals) == 2
    assert c.all("inner.head.output")[1].shape == (2, 4)
    assert c.steps_of("inner.head.output") == [0, 0]
    assert len(c.step(0).all("inner.head.output")) == 2
    assert len(c.step(0)) == 1 and len(c) == 1             # step() copies; the cache keeps its values
    with pytest.raises(IndexError, match=r"nothing was recorded in step 1; recorded steps: \[0\]"):
        c.step(1)
    assert list(c.recorded) == c.keys() == ["inner.head.output"]
    assert repr(c.inner) == "<cache entries under 'inner': 1 keys>"
    with pytest.raises(AttributeError, match="the cache has nothing under 'inner.tail'"):
        c.inner.tail


def test_cache_across_generation_steps_equals_hooks():
    pytest.importorskip("asyncinterp.models.hf.language")
    from asyncinterp.models import tiny
    lm = tiny("gpt2")
    net = lm.module
    cache = ai.Cache(["transformer.h.0", "lm_head"])
    gen = lm.generate("Hello world", cache, max_new_tokens=3)
    assert gen.result is cache
    assert cache.steps_of("transformer.h.0.output") == [0, 1, 2]
    saved = []
    h = net.transformer.h[0].register_forward_hook(lambda m, a, o: saved.append(o.detach()))
    lm.generate("Hello world", max_new_tokens=3)
    h.remove()
    vals = cache.all("transformer.h.0.output")
    assert len(vals) == len(saved) == 3
    for a, b in zip(vals, saved):
        assert torch.equal(a, b)
    step1 = cache.step(1)
    assert torch.equal(step1.transformer.h[0].output, saved[1])
    assert step1.lm_head.output.shape[1] == 1


def test_cache_page_runs(capsys):
    pytest.importorskip("asyncinterp.models.hf.language")
    from docsnippets import python_blocks, run_page
    assert len(python_blocks("cache.md")) >= 6
    ns = run_page("cache.md")
    out = capsys.readouterr().out
    assert "model.layers.0.output: Tensor(2, 6, 32)" in out and "[0, 1, 2]" in out
    assert ns["a"].model.layers[1].output.abs().sum() == 0


# ------------------------------------------------------------ lookups fail like lists and dicts
def test_lookups_raise_key_and_index_errors_with_suggestions(net):
    model = ai.wrap(net)
    c = ai.cache(model, torch.randn(2, 8), "layers.*")
    with pytest.raises(KeyError, match=r"'layers\.1\.outptu' is not in this cache; did you mean one of \['layers\.1\.output'"):
        c["layers.1.outptu"]
    with pytest.raises(KeyError, match="did you mean"):
        c["nothing.here"]                                   # was a silent empty node
    with pytest.raises(KeyError):
        c.all("layers.1")
    with pytest.raises(KeyError):
        c[3]
    with pytest.raises(IndexError, match="nothing under 'layers.99'"):
        c.layers[99]
    with pytest.raises(KeyError, match="nothing under 'layers.1.outptu'"):
        c.layers[1]["outptu"]
    with pytest.raises(KeyError, match=r"nothing under 'layrs'.*did you mean"):
        c.layrs                                             # was a silent empty node
    with pytest.raises(AttributeError):                     # also an AttributeError: hasattr works
        c.layers[1].outptu
    assert not hasattr(c, "layrs") and hasattr(c, "layers")
    assert getattr(c.layers, "nope", None) is None
    with pytest.raises(IndexError, match="recorded steps: \\[0\\]"):
        c.step(5)
    assert len(c.step(-1)) == len(c)
    with pytest.raises(IndexError):
        c.step(-2)
    with pytest.raises(KeyError, match="empty"):
        ai.Cache()["layers.0.output"]
    assert str(KeyError) and "did you mean" in str(pytest.raises(KeyError, c.__getitem__, "layers.0.outpt").value)


# ------------------------------------------------------------ recording partway through a run
def test_start_and_stop_from_an_intervention(net):
    model = ai.wrap(net)
    x = torch.randn(2, 8)
    c = ai.Cache("layers.*", start=False)

    async def window(m):
        await m.layers[1].output
        c.start()                       # layer 1 on: the cache is on when the model continues past it
        await m.layers[3].output
        c.stop()                        # layer 3 off, for the same reason

    model.trace(x, c, window)
    assert c.keys() == ["layers.1.output", "layers.2.output"]
    full = ai.cache(model, x, "layers.*")
    assert torch.equal(c.layers[2].output, full.layers[2].output)

    model.trace(x, c)                   # start()/stop() of an earlier run do not carry over: starts paused
    assert len(c) == 0

    on = ai.Cache("layers.*")

    async def stop_early(m):
        await m.layers[0].output
        on.stop()

    model.trace(x, on, stop_early)
    assert on.keys() == []              # stopped inside layer 0's firing: nothing recorded


def test_steps_option_records_only_those_generation_steps():
    pytest.importorskip("asyncinterp.models.hf.language")
    from asyncinterp.models import tiny
    lm = tiny("gpt2")
    every = ai.Cache(["lm_head"])
    later = ai.Cache(["lm_head"], steps=slice(1, None))
    odd = ai.Cache(["lm_head"], steps=range(1, 10, 2))
    one = ai.Cache(["lm_head"], steps=2)
    with lm.generate(max_new_tokens=4) as tr:
        tr.invoke("Hello world", every, later, odd, one)
    assert every.steps_of("lm_head.output") == [0, 1, 2, 3]
    assert later.steps_of("lm_head.output") == [1, 2, 3]
    assert odd.steps_of("lm_head.output") == [1, 3]
    assert one.steps_of("lm_head.output") == [2]
    for s in (1, 2, 3):
        assert torch.equal(later.step(s).lm_head.output, every.step(s).lm_head.output)
    with pytest.raises(IndexError):
        later.step(0)
    with pytest.raises(TypeError):
        ai.Cache(steps=1.5)
