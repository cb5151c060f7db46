"""atrace under asyncio and trio, cancellation, bad input, and leak-freedom over many runs."""

import gc
import threading
import time
import weakref

import anyio
import pytest
import torch

import asyncinterp as ai
from conftest import hook_count


class Slow(torch.nn.Module):
    """Ten layers that each sleep, so a cancel lands mid-forward."""

    def __init__(self, delay=0.05):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(10))
        self.delay = delay
        self.calls = 0

    def forward(self, x):
        for layer in self.layers:
            self.calls += 1
            time.sleep(self.delay)
            x = layer(x)
        return x


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
def test_atrace_matches_trace_and_keeps_loop_free(mlp, anyio_backend):
    model = ai.wrap(mlp)
    x = torch.randn(2, 8)

    async def read(m):
        return (await m.layers[2].output).clone()

    expected = model.trace(x, read)

    async def main():
        ticks = 0
        result = None

        async def ticker():
            nonlocal ticks
            while result is None:
                ticks += 1
                await anyio.sleep(0.001)

        async def work():
            nonlocal result
            result = await model.atrace(x, read)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            tg.start_soon(work)
        return result, ticks

    result, _ = anyio.run(main, backend=anyio_backend)
    assert torch.equal(result, expected)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
def test_cancel_stops_forward_at_next_hook_point(anyio_backend):
    torch.manual_seed(0)
    net = Slow()
    model = ai.wrap(net)
    x = torch.randn(1, 4)
    reference = net(x).detach().clone()
    net.calls = 0
    finally_ran = []

    async def waits_for_the_end(m):
        try:
            await m.layers[9].output
        finally:
            finally_ran.append(True)

    async def main():
        with anyio.move_on_after(0.12) as scope:
            await model.atrace(x, waits_for_the_end)
        return scope.cancelled_caught

    t0 = time.perf_counter()
    cancelled = anyio.run(main, backend=anyio_backend)
    elapsed = time.perf_counter() - t0
    assert cancelled
    assert net.calls < 10, "the forward should stop at a hook point, not run to the end"
    assert elapsed < 0.45
    assert finally_ran == [True]
    assert hook_count(net) == 0
    assert torch.equal(net(x), reference)  # model exactly as before


def test_fail_after_raises_timeout_and_model_is_clean():
    net = Slow(delay=0.03)
    model = ai.wrap(net)

    async def fn(m):
        return await m.layers[9].output

    async def main():
        with anyio.fail_after(0.05):
            await model.atrace(torch.randn(1, 4), fn)

    with pytest.raises(TimeoutError):
        anyio.run(main)
    assert hook_count(net) == 0
    assert threading.active_count() < 50


def test_in_loop_calls_back_into_the_event_loop(mlp):
    model = ai.wrap(mlp)
    seen = []

    async def app_side(value):
        await anyio.sleep(0)
        seen.append(value)
        return value * 2

    async def fn(m):
        h = await m.layers[0].output
        return await ai.in_loop(app_side, h.shape[0])

    assert anyio.run(model.atrace, torch.randn(3, 8), fn) == 6
    assert seen == [3]
    with pytest.raises(RuntimeError, match="atrace"):
        model.trace(torch.randn(3, 8), fn)


def test_trace_works_inside_a_running_event_loop(mlp):
    model = ai.wrap(mlp)

    async def fn(m):
        return (await m.head.output).shape

    async def main():
        return model.trace(torch.randn(2, 8), fn)

    assert anyio.run(main) == (2, 4)


def test_bad_interventions_get_type_errors(mlp):
    model = ai.wrap(mlp)

    def plain(m):
        return 1

    async def fn(m):
        return 1

    with pytest.raises(TypeError, match="async def"):
        model.trace(torch.randn(1, 8), plain)
    coro = fn(model)
    with pytest.raises(TypeError, match="coroutine object"):
        model.trace(torch.randn(1, 8), coro)
    coro.close()
    with pytest.raises(TypeError):
        model.trace(torch.randn(1, 8), 42)
    assert hook_count(mlp) == 0


def test_await_outside_a_run_explains_where(mlp):
    model = ai.wrap(mlp)

    async def direct():
        return await model.layers[0].output

    with pytest.raises(ai.NotInRunError, match="inside an intervention"):
        anyio.run(direct)


def test_proxy_of_another_model_is_refused(mlp):
    other = ai.wrap(torch.nn.Sequential(torch.nn.Linear(8, 8)))
    model = ai.wrap(mlp)

    async def wrong(m):
        return await other[0].output

    with pytest.raises(ai.NotInRunError, match="another wrapped model"):
        model.trace(torch.randn(1, 8), wrong)


def test_wrong_module_name_lists_closest(mlp):
    model = ai.wrap(mlp)
    with pytest.raises(ai.ModulePathError, match="'layers'"):
        model.layerz
    with pytest.raises(ai.ModulePathError, match="out of range"):
        model.layers[17]


def test_no_leaks_over_many_runs(mlp):
    """1,000 runs (ok, failing, stopped, out of order): no hook, task or tensor survives."""
    model = ai.wrap(mlp)
    x = torch.randn(2, 8)
    refs = []

    async def ok(m):
        h = await m.layers[1].output
        refs.append(weakref.ref(h))
        return h.sum()

    async def fails(m):
        h = await m.layers[2].output
        refs.append(weakref.ref(h))
        raise ValueError("x")

    async def stops(m):
        h = await m.layers[0].output
        refs.append(weakref.ref(h))
        m.stop()

    async def ooo(m):
        h = await m.layers[3].output
        refs.append(weakref.ref(h))
        await m.layers[0].output

    for i in range(1000):
        kind = i % 4
        try:
            model.trace(x, (ok, fails, stops, ooo)[kind])
        except (ValueError, ai.OutOfOrderError):
            pass
    gc.collect()
    assert hook_count(mlp) == 0
    alive = sum(r() is not None for r in refs)
    assert alive == 0, f"{alive} activation tensors still referenced"
    from asyncinterp.kernel.scheduler import Task
    assert not [o for o in gc.get_objects() if type(o) is Task]
    assert not model.run_lock.locked()
