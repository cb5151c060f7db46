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
    StepTrap,
    UnsetFutureError,
    trap,
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
        k.request_stop()
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


# ------------------------------------------------------------------ ending: one sweep, three scopes


def test_finish_settles_whatever_the_code_after_a_step_loop_awaits():
    # once the run has ended, every new wait on a step, a point or an unset future resumes at once,
    # so the one sweep of finish leaves nothing to wake: the code after the loop runs to its end
    log = []
    never = Future("never")

    async def child():
        try:
            await P("zz")
        except MissedHookPoint as e:
            log.append(("child", "missed", "already ended" in str(e)))
        return "child"

    async def body():
        async for step in Steps():
            log.append(("step", step))
        log.append("after loop")
        try:
            await P("b")
        except MissedHookPoint as e:
            log.append(("point", "already ended" in str(e)))
        log.append(("next step", await trap(StepTrap())))
        try:
            await never
        except UnsetFutureError:
            log.append("future")
        handle = await spawn(child())
        log.append(("joined", await handle))
        return "done"

    k = make()
    t = k.spawn(body(), 0)
    run(k, ["a"])
    assert log == [("step", 0), "after loop", ("point", True), ("next step", None), "future",
                   ("child", "missed", True), ("joined", "child")]
    assert t.result == "done" and k.failures == []


def test_finish_wakes_step_loops_then_points_then_futures_in_creation_order():
    log = []
    fut = Future("f")

    async def stepper():
        async for _ in Steps():
            await P("a")
        log.append("stepper")

    async def pointer():
        try:
            await P("zz")
        except MissedHookPoint:
            log.append("pointer")

    async def waiter(name):
        try:
            await fut
        except UnsetFutureError:
            log.append(name)

    k = make()
    k.spawn(waiter("waiter 1"), 0)
    k.spawn(pointer(), 1)
    k.spawn(stepper(), 2)
    k.spawn(waiter("waiter 2"), 0)
    run(k, ["a"])
    assert log == ["stepper", "pointer", "waiter 1", "waiter 2"]


def test_end_step_loops_leaves_point_and_future_waits_for_close():
    log = []
    fut = Future("f")

    async def stepper():
        async for _ in Steps():
            await P("a")
        log.append("after loop")
        await P("b")   # the run has ended: fails at once
        log.append("unreachable")

    async def parked(awaitable, name):
        try:
            await awaitable
        finally:
            log.append(f"{name} closed")

    k = make()
    t = k.spawn(stepper(), 0)
    p = k.spawn(parked(P("zz"), "point"), 1)
    f = k.spawn(parked(fut, "future"), 2)
    k.drain()
    k.provide("a", lambda task, trap: None)
    k.request_stop()
    k.end_step_loops()
    assert log == ["after loop"] and isinstance(t.exc, MissedHookPoint)
    assert not p.done and not f.done
    k.close()
    assert log == ["after loop", "point closed", "future closed"] and p.closed and f.closed


def test_end_group_ends_only_that_invoke_and_keeps_its_future_waits():
    log = []
    fut = Future("shared")

    async def ending():
        async for step in Steps():
            log.append(("ending", step))
            await P("a")
        log.append(("ending", "after loop", await trap(StepTrap())))
        log.append(("ending", "got", await fut))   # another invoke may still set it: the wait stays

    async def going_on():
        async for step in Steps():
            await P("a")
            if step == 1:
                fut.set_result("late")
                return step

    k = Kernel(FakeHost(order=()), on_error="continue")
    t0 = k.spawn(ending(), 0)
    t1 = k.spawn(going_on(), 1)
    k.drain()
    k.provide("a", lambda task, trap: None)
    k.end_group(0)
    assert log == [("ending", 0), ("ending", "after loop", None)] and not t0.done
    k.begin_step()
    k.provide("a", lambda task, trap: None)
    assert t1.result == 1 and t0.done and log[-1] == ("ending", "got", "late")
    k.finish()
    assert k.failures == []


def test_finish_applies_pending_cancels_first():
    log = []

    async def body(name):
        try:
            async for _ in Steps():
                await P("a")
            log.append(f"{name} after loop")
        finally:
            log.append(f"{name} finally")

    k = make()
    k.spawn(body("x"), 0)
    k.spawn(body("y"), 1)
    k.drain()
    k.provide("a", lambda task, trap: None)   # both wait for the next step
    k.cancel_group(0)
    k.finish()
    assert log == ["x finally", "y after loop", "y finally"]


def test_fail_raises_in_a_parked_task_and_records_it_on_a_done_one():
    async def catches():
        try:
            await P("zz")
        except KeyError as e:
            return ("caught", e.args[0])

    async def quick():
        return 1

    k = make(on_error="continue")
    parked = k.spawn(catches(), 0)
    done = k.spawn(quick(), 1)
    k.drain()
    k.fail(parked, KeyError("x"))
    assert parked.result == ("caught", "x") and k.failures == []
    late = ValueError("late")
    k.fail(done, late)
    assert done.exc is late and k.failures == [late]
    k.finish()


def test_a_stale_step_wait_is_not_resumed_by_the_next_step():
    # a task failed (kernel.fail) while parked on a step, which then waits on a future: the next step must
    # not resume it (only a task still waiting on a step is)
    fut = Future("f")
    log = []

    async def body():
        try:
            async for _ in Steps():
                await P("a")
        except KeyError:
            log.append(("future", await fut))

    k = make()
    t = k.spawn(body(), 0)
    k.drain()
    k.provide("a", lambda task, trap: None)   # now parked on the next step
    k.fail(t, KeyError("x"))                  # now parked on fut, still listed as a step waiter
    k.begin_step()
    assert log == [] and not t.done
    fut.set_result(5)
    k.drain()
    assert log == [("future", 5)]
    k.finish()


def test_current_run_is_the_host_of_the_running_task():
    from asyncinterp import current_run as top_level
    from asyncinterp.kernel import current_run

    assert top_level is current_run
    seen = []

    async def body():
        seen.append(current_run())

    k = make()
    host = k.host
    k.spawn(body(), 0)
    run(k, [])
    assert seen == [host] and current_run() is None


def test_asyncio_without_a_loop_is_a_foreign_await_and_other_runtime_errors_are_not():
    async def sleeps():
        await asyncio.sleep(0.01)   # asyncio raises RuntimeError: no event loop runs in the forward

    async def raises():
        raise RuntimeError("no running event loop")   # the user's own error, whatever it says

    k = make(on_error="continue")
    a = k.spawn(sleeps(), 0)
    b = k.spawn(raises(), 1)
    k.drain()
    assert isinstance(a.exc, ForeignAwaitError) and "ai.in_loop" in str(a.exc)
    assert isinstance(a.exc.__cause__, RuntimeError)
    assert type(b.exc) is RuntimeError
    k.close()
