"""Kernel unit tests: a scripted fake model drives the scheduler, no torch involved."""

import asyncio

import pytest

from asyncinterp import gather, spawn
from asyncinterp.kernel import (
    ForeignAwaitError,
    Future,
    Kernel,
    MissedHookPoint,
    OutOfOrderError,
    UnsetFutureError,
)
from asyncinterp.kernel.tasks import Steps
from gc_helpers import settle_garbage
from kernelfakes import FakeHost, P


def run(kernel, script, values=None):
    """Drive the kernel through a sequence of point names (None = new step)."""
    kernel.drain()
    for name in script:
        if name is None:
            kernel.begin_step()
            continue
        v = (values or {}).get(name, name.upper())
        kernel.provide(name, lambda task, trap, v=v: (v, task.group))
    kernel.finish()


def make(on_error="stop", order=("a", "b", "c", "d")):
    return Kernel(FakeHost(order), on_error=on_error)


def test_tasks_resume_in_invoke_order_and_get_their_view():
    events = []

    def fn(tag):
        async def body():
            v = await P("a")
            events.append((tag, "a", v))
            v = await P("c")
            events.append((tag, "c", v))
            return tag
        return body

    k = make()
    host = k.host  # close() (run by finish) drops the kernel's reference to its host
    t1 = k.spawn(fn("second")(), group=1)
    t0 = k.spawn(fn("first")(), group=0)
    run(k, ["a", "b", "c"])
    assert events == [
        ("first", "a", ("A", 0)), ("second", "a", ("A", 1)),
        ("first", "c", ("C", 0)), ("second", "c", ("C", 1)),
    ]
    assert (t0.result, t1.result) == ("first", "second")
    assert k.failures == []
    assert k.host is None
    assert host.activated.count("a") == 2


def test_future_shared_across_invokes_within_one_firing():
    fut = Future()
    log = []

    async def consumer():  # invoke 0 runs first at "b" but needs invoke 1's value
        await P("b")
        log.append("consumer at b")
        got = await fut
        log.append(("consumer got", got))
        await P("c")
        log.append("consumer at c")

    async def producer():
        v = await P("b")
        log.append("producer at b")
        fut.set_result(v[0] + "!")

    k = make()
    k.spawn(consumer(), 0)
    k.spawn(producer(), 1)
    k.drain()
    k.provide("a", lambda t, tr: "A")
    k.provide("b", lambda t, tr: ("B", t.group))
    # the consumer was resumed inside the same firing, before the model moved on
    assert log == ["consumer at b", "producer at b", ("consumer got", "B!")]
    k.provide("c", lambda t, tr: "C")
    k.finish()
    assert log[-1] == "consumer at c"
    assert k.failures == []


def test_out_of_order_raises_immediately_naming_both_points():
    async def body():
        await P("c")
        await P("a")

    k = make()
    t = k.spawn(body(), 0)
    run(k, ["a", "b", "c", "d"])
    assert isinstance(t.exc, OutOfOrderError)
    msg = str(t.exc)
    assert "awaited a" in msg and "at c" in msg and "test_kernel.py" in msg


def test_out_of_order_detected_from_fire_counts_without_static_order():
    async def body():
        await P("y")
        await P("x")

    k = Kernel(FakeHost(order=()))
    t = k.spawn(body(), 0)
    k.drain()
    k.provide("x", lambda t, tr: 1)
    k.provide("y", lambda t, tr: 2)
    k.finish()
    assert isinstance(t.exc, OutOfOrderError)


def test_second_await_binds_to_second_call():
    got = []

    async def body():
        got.append(await P("a"))
        got.append(await P("a"))

    k = make()
    k.spawn(body(), 0)
    k.drain()
    k.provide("a", lambda t, tr: 1)
    k.provide("a", lambda t, tr: 2)
    k.finish()
    assert got == [1, 2]


def test_missed_point_names_point_and_line():
    async def body():
        await P("zzz")

    k = make()
    t = k.spawn(body(), 0)
    run(k, ["a", "b"])
    assert isinstance(t.exc, MissedHookPoint)
    assert "zzz" in str(t.exc) and "test_kernel.py" in str(t.exc)
    assert k.failures == [t.exc]


def test_missed_point_at_step_end_never_binds_to_next_step():
    got = []

    async def body():
        got.append(await P("a"))
        got.append(await P("a"))  # only one call of a per step

    k = make()
    t = k.spawn(body(), 0)
    run(k, ["a", "b", None, "a", "b"])
    assert got == [("A", 0)]
    assert isinstance(t.exc, MissedHookPoint)
    assert "steps()" in str(t.exc)


def test_steps_loop_ends_cleanly_and_code_after_it_runs():
    seen = []

    async def body():
        async for step in Steps():
            seen.append((step, await P("b")))
        seen.append("after")
        return len(seen)

    k = make()
    t = k.spawn(body(), 0)
    run(k, ["a", "b", "c", None, "a", "b", None, "a", "b"])
    assert seen == [(0, ("B", 0)), (1, ("B", 0)), (2, ("B", 0)), "after"]
    assert t.result == 4 and t.exc is None


def test_several_failures_are_all_reported():
    async def bad(n):
        await P("a")
        raise ValueError(n)

    k = make()
    k.spawn(bad(1), 0)
    k.spawn(bad(2), 1)
    k.drain()
    k.provide("a", lambda t, tr: None)
    assert k.interrupted
    k.close()
    assert [e.args[0] for e in k.failures] == [1, 2]
    assert all(any("after hook point a" in n for n in e.__notes__) for e in k.failures)


def test_foreign_await_gets_clear_error_at_the_await():
    async def body():
        await asyncio.sleep(0)

    k = make()
    t = k.spawn(body(), 0)
    k.drain()
    assert isinstance(t.exc, ForeignAwaitError)
    assert "ai.in_loop" in str(t.exc)


def test_gather_waits_for_points_in_any_order():
    out = []

    async def body():
        d, b = await gather(P("d"), P("b"))
        out.append((d, b))
        c = await P("c")  # b was consumed by the sub-task; c is still ahead... but d ran after c
        out.append(c)

    k = make()
    t = k.spawn(body(), 0)
    run(k, ["a", "b", "c", "d"])
    assert out == [(("D", 0), ("B", 0))]
    # after gather the task is at d, so awaiting c is out of order
    assert isinstance(t.exc, OutOfOrderError)


def test_spawned_subtask_runs_on_same_invoke():
    async def child():
        return await P("c")

    async def parent():
        h = await spawn(child())
        b = await P("b")
        return b, await h

    k = make()
    t = k.spawn(parent(), 3)
    run(k, ["a", "b", "c"])
    assert t.result == (("B", 3), ("C", 3))


def test_unset_future_fails_clearly():
    fut = Future("never")

    async def body():
        await fut

    k = make()
    t = k.spawn(body(), 0)
    run(k, ["a"])
    assert isinstance(t.exc, UnsetFutureError) and "never" in str(t.exc)


def test_close_runs_finally_blocks():
    log = []

    async def body():
        try:
            await P("zz")
        finally:
            log.append("finally")

    k = make()
    k.spawn(body(), 0)
    k.drain()
    k.close()
    assert log == ["finally"]


def test_future_set_before_run_is_ready_at_once():
    fut = Future()
    fut.set_result(7)

    async def body():
        return await fut

    k = make()
    t = k.spawn(body(), 0)
    run(k, [])
    assert t.result == 7


@pytest.mark.parametrize("n", [1, 5])
def test_stop_request_interrupts(n):
    async def body():
        await P("a")
        k.stop_requested = True
        return "stopped"

    k = make()
    t = k.spawn(body(), 0)
    k.drain()
    k.provide("a", lambda t, tr: None)
    assert k.interrupted and t.result == "stopped"


def _workload(k, fut, late):
    """Tasks that use every kind of wait: points, futures, spawn/join (gather), steps."""

    async def producer():
        await P("a")
        fut.set_result(1)
        await P("c")
        late.set_result(2)
        return "p"

    async def consumer():
        v = await fut                       # parks until the producer sets it
        child = await spawn(P("b"))
        x, y = await gather(P("c"), P("d"))
        b = await child
        w = await late
        return v, b, x, y, w

    async def stepper():
        seen = []
        async for step in Steps():
            seen.append(step)
            await P("a")
        return seen

    return [k.spawn(producer(), 0), k.spawn(consumer(), 1), k.spawn(stepper(), 2)]


def test_finished_kernel_leaves_no_reference_cycles():
    import gc
    import weakref

    settle_garbage()
    gc.disable()
    try:
        fut, late = Future("f"), Future("late")
        k = make()
        tasks = _workload(k, fut, late)
        run(k, ["a", "b", "c", "d", None, "a", "b", "c", "d"])
        assert k.failures == []
        assert [t.result for t in tasks] == ["p", (1, ("B", 1), ("C", 1), ("D", 1), 2), [0, 1]]
        refs = [weakref.ref(k)] + [weakref.ref(t) for t in tasks]
        del k, tasks
        assert all(r() is None for r in refs)  # freed by reference counting alone
        assert gc.collect() == 0
    finally:
        gc.enable()


def test_closing_a_kernel_mid_run_undoes_every_wait():
    import gc
    import weakref

    settle_garbage()
    gc.disable()
    try:
        fut, late = Future("f"), Future("late")
        k = make()
        tasks = _workload(k, fut, late)

        async def waiter():
            return await late

        tasks.append(k.spawn(waiter(), 3))
        run_steps = ["a", "b"]  # now the consumer waits on a join, the waiter on a future, the others on points
        k.drain()
        for name in run_steps:
            k.provide(name, lambda task, trap: (name.upper(), task.group))
        k.close()  # no finish: every task is closed where it waits
        assert all(t.closed for t in tasks) and k.failures == []
        refs = [weakref.ref(k)] + [weakref.ref(t) for t in tasks]
        del k, tasks
        assert all(r() is None for r in refs)
        late.set_result(3)  # nobody waits any more: the kernel's callback is gone
        assert gc.collect() == 0
    finally:
        gc.enable()
