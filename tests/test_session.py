"""Sessions: values and futures shared between runs, as plain Python."""

import asyncio

import pytest
import torch

import asyncinterp as ai
from conftest import MLP


@pytest.fixture
def net():
    torch.manual_seed(0)
    return MLP().eval()


def test_value_from_run1_patched_into_run2_equals_hooks(net):
    model = ai.wrap(net)
    x_clean, x_bad = torch.randn(1, 8), torch.randn(1, 8)

    with model.session() as s:
        async def record(m):
            s["clean"].set_result((await m.layers[2].output).clone())

        async def patch(m):
            h = await m.layers[2].output
            h[:] = await s["clean"]
            return await m.output

        s.trace(x_clean, record)
        got = s.trace(x_bad, patch).result
        assert s.unset() == [] and len(s.runs) == 2

    saved = {}
    h = net.layers[2].register_forward_hook(lambda m, a, o: saved.update(h=o.detach().clone()))
    net(x_clean)
    h.remove()
    h = net.layers[2].register_forward_hook(lambda m, a, o: saved["h"])
    want = net(x_bad)
    h.remove()
    assert torch.equal(got, want)
    assert s.futures == {} and s.closed
    with pytest.raises(RuntimeError, match="closed"):
        s.future("x")


def test_plain_future_across_traces_and_two_models(net):
    torch.manual_seed(1)
    other = MLP().eval()
    a, b = ai.wrap(net), ai.wrap(other)
    direction = ai.Future()

    async def take(m):
        direction.set_result((await m.layers[5].output).mean(0))

    async def steer(m):
        h = await m.layers[5].output
        h += await direction
        return await m.output

    a.trace(torch.randn(4, 8), take)
    s = ai.Session()
    out = s.trace(torch.randn(2, 8), steer, model=b).result
    assert out.shape == (2, 4)
    with pytest.raises(TypeError, match="default model"):
        s.trace(torch.randn(1, 8), steer)


def test_future_set_by_a_later_run_fails_clearly(net):
    model = ai.wrap(net)
    s = model.session()
    later = s.future("later")

    async def early(m):
        await m.layers[0].output
        return await later

    with pytest.raises(ai.UnsetFutureError, match="later"):
        s.trace(torch.randn(1, 8), early)
    assert s.unset() == ["later"]


def test_session_runs_with_invokes_and_atrace(net):
    model = ai.wrap(net)

    async def main():
        async with model.session() as s:
            async def grab(m):
                s["h"].set_result((await m.layers[1].output).clone())
            await s.atrace(torch.randn(2, 8), grab)
            with s.trace() as tr:
                async def use(m):
                    h = await m.layers[1].output
                    h[:] = (await s["h"])[:1]
                    return await m.output
                inv = tr.invoke(torch.randn(1, 8), use)
            return inv.result

    out = asyncio.run(main())
    assert out.shape == (1, 4)


def test_sessions_page_runs(capsys):
    from docsnippets import python_blocks, run_page
    assert len(python_blocks("sessions.md")) >= 4
    ns = run_page("sessions.md")
    out = capsys.readouterr().out
    assert "2 []" in out and "UnsetFutureError ['later']" in out
    assert torch.equal(ns["result"], ns["patched"])


def test_session_value_steers_a_later_generation():
    pytest.importorskip("asyncinterp.models.hf.language")
    from asyncinterp.models import tiny
    lm = tiny("llama")
    with lm.session() as s:
        async def direction(m):
            h = await m.layers[0].output
            s["dir"].set_result(h[0, -1].clone() * 5)

        async def steer(m):
            async for _ in m.steps():
                h = await m.layers[0].output
                h += await s["dir"]

        s.trace("Paris is a city", direction)
        gen = s.generate("Once upon a time", steer, max_new_tokens=3)
        vec = s["dir"].result()

    handle = lm.module.model.layers[0].register_forward_hook(lambda mod, a, o: o + vec)
    try:
        want = lm.generate("Once upon a time", max_new_tokens=3)
    finally:
        handle.remove()
    assert torch.equal(gen.tokens, want.tokens)
