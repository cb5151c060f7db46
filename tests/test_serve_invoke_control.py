"""Per-invoke control used by serving: cancel one invoke, end one invoke early.

``Invoke.cancel()`` (thread-safe) closes that invoke's tasks at the next hook
point while the forward and the other invokes go on; ``Kernel.end_group``
ends one invoke's run (its step loop ends, the code after it runs) while the
others keep generating.
"""

import threading

import pytest
import torch

import asyncinterp as ai
from asyncinterp.kernel import Kernel, MissedHookPoint
from asyncinterp.kernel.tasks import Steps
from kernelfakes import FakeHost, P


def Host():
    return FakeHost(order=())


def test_cancel_group_closes_only_that_group():
    k = Kernel(Host(), on_error="continue")
    log = []

    async def fn(name):
        try:
            a = await P("a")
            log.append((name, "a", a))
            b = await P("b")
            log.append((name, "b", b))
            return name
        finally:
            log.append((name, "finally"))

    t0 = k.spawn(fn("x"), 0)
    t1 = k.spawn(fn("y"), 1)
    k.drain()
    k.provide("a", lambda task, trap: 1)
    k.cancel_group(0)           # from "another thread": only a list append
    assert not t0.done           # applied at the next hook point, not now
    k.provide("b", lambda task, trap: 2)
    k.finish()
    assert t0.closed and t0.done and t0.result is None
    assert t1.result == "y" and not t1.closed
    assert ("x", "finally") in log and ("x", "b", 2) not in log
    assert ("y", "b", 2) in log


def test_end_group_ends_step_loop_and_code_after_runs():
    k = Kernel(Host(), on_error="continue")

    async def gen(m_steps):
        seen = []
        async for step in Steps(None):
            seen.append((step, await P("h")))
        return ("after loop", seen)

    t0 = k.spawn(gen(None), 0)
    t1 = k.spawn(gen(None), 1)
    k.drain()
    k.provide("h", lambda task, trap: "s0")
    k.end_group(0)               # invoke 0 generated all it asked for
    k.begin_step()
    k.provide("h", lambda task, trap: "s1")
    k.begin_step()
    k.provide("h", lambda task, trap: "s2")
    k.finish()
    assert t0.result == ("after loop", [(0, "s0")])
    assert t1.result == ("after loop", [(0, "s0"), (1, "s1"), (2, "s2")])


def test_end_group_misses_pending_point_and_later_awaits():
    k = Kernel(Host(), on_error="continue")

    async def waits():
        await P("a")
        await P("later")

    async def after():
        await P("a")
        try:
            await P("z")
        except MissedHookPoint as exc:
            return str(exc)

    t0 = k.spawn(waits(), 0)
    t1 = k.spawn(after(), 1)
    k.drain()
    k.provide("a", lambda task, trap: 0)
    k.end_group(0)
    k.end_group(1)
    k.finish()
    assert isinstance(t0.exc, MissedHookPoint) and "this invoke's run ended" in str(t0.exc)
    assert "ended" in t1.result


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x):
        return self.layers(x)


def test_invoke_cancel_from_another_thread_mid_forward():
    torch.manual_seed(0)
    model = ai.wrap(MLP())
    x = torch.randn(3, 8)
    closed = []
    started = threading.Event()
    go = threading.Event()

    async def victim(m):
        try:
            await m.layers[0].output
            started.set()
            go.wait(5)           # the "other thread" cancels us meanwhile
            for i in range(1, 4):
                await m.layers[i].output
            return "finished"
        finally:
            closed.append(True)

    async def other(m):
        h = await m.layers[3].output
        return h.clone()

    with model.trace(on_error="continue") as tr:
        v = tr.invoke(x[:1], victim)
        o = tr.invoke(x[1:], other)
        threading.Thread(target=lambda: (started.wait(5), v.cancel(), go.set())).start()
    with pytest.raises(ai.RunCancelled):
        v.result
    assert closed == [True]
    ref = model.trace(x[1:], other)
    assert torch.equal(o.result, ref)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.module.modules())


def test_invoke_cancelled_before_run_never_starts():
    model = ai.wrap(MLP())
    started = []

    async def fn(m):
        started.append(1)
        return await m.layers[1].output

    with model.trace(on_error="continue") as tr:
        a = tr.invoke(torch.randn(1, 8), fn)
        b = tr.invoke(torch.randn(1, 8), fn)
        a.cancel()
    with pytest.raises(ai.RunCancelled):
        a.result
    assert b.result.shape == (1, 8)
    assert started == [1]


def test_cancel_after_the_run_keeps_the_result():
    model = ai.wrap(MLP())

    async def fn(m):
        return (await m.layers[1].output).clone()

    with model.trace(on_error="continue") as tr:
        a = tr.invoke(torch.randn(1, 8), fn)
    a.cancel()                       # too late: a no-op
    assert a.result.shape == (1, 8)
