"""The event-loop primitives a worker process is built on: tasks beside a main coroutine, quiet cancels, watched
calls."""

import time

import anyio
import pytest

from asyncinterp import aio


def test_run_with_tasks_waits_for_every_task():
    done = []

    async def child(i):
        await anyio.sleep(0.01 * i)
        done.append(i)

    async def main(start):
        for i in range(3):
            start(child, i)
        done.append("main")

    aio.run_with_tasks(main)
    assert done == ["main", 0, 1, 2]


def test_a_failing_task_cancels_main_and_the_others_and_is_raised():
    seen = []

    async def bad():
        await anyio.sleep(0.01)
        raise ValueError("boom")

    async def slow():
        try:
            await anyio.sleep(5)
        finally:
            seen.append("slow ended")

    async def main(start):
        start(bad)
        start(slow)
        await anyio.sleep(5)
        seen.append("main went on")

    t0 = time.monotonic()
    with pytest.raises(ValueError, match="boom"):
        aio.run_with_tasks(main)
    assert time.monotonic() - t0 < 2
    assert seen == ["slow ended"]


def test_cancel_scopes_and_timeouts_work_in_the_tasks():
    out = {}

    async def scoped():
        with aio.cancel_scope() as scope:
            out["scope"] = scope
            await anyio.sleep(5)
        out["cancelled"] = scope.cancelled_caught

    async def timed():
        try:
            with aio.fail_at(time.monotonic() + 0.02):
                await anyio.sleep(5)
        except TimeoutError:
            out["timed out"] = True

    async def main(start):
        start(scoped)
        start(timed)
        await anyio.sleep(0.05)
        aio.cancel_quietly(out["scope"])

    aio.run_with_tasks(main)
    assert out["cancelled"] and out["timed out"]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_cancel_quietly_cancels_at_the_next_turn(backend):
    async def main():
        with aio.cancel_scope() as scope:
            aio.cancel_quietly(scope)
            await anyio.sleep(5)
        return scope.cancelled_caught

    t0 = time.monotonic()
    assert anyio.run(main, backend=backend)
    assert time.monotonic() - t0 < 1


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_run_watched_reports_the_first_to_end(backend):
    async def value():
        await anyio.sleep(0.01)
        return 7

    async def never():
        await anyio.sleep(5)

    async def soon():
        await anyio.sleep(0.01)

    async def main():
        first = await aio.run_watched(value, never)
        second = await aio.run_watched(never, soon)
        third = await aio.run_watched(value, value)   # both end at once: fn's value wins only if it ends first
        return first, second, third

    first, second, third = anyio.run(main, backend=backend)
    assert (first.stopped, first.value) == (False, 7)
    assert second.stopped and second.value is None
    assert third.stopped or third.value == 7


def test_readiness_is_readable_when_the_pipe_has_data_and_ends_when_told():
    import os
    read_end, write_end = os.pipe()
    seen = []
    try:
        async def main(start):
            ready = aio.Readiness(read_end)

            async def writer():
                await anyio.sleep(0.02)
                os.write(write_end, b"x")

            start(writer)
            seen.append(await ready.wait())       # the write wakes it
            assert os.read(read_end, 1) == b"x"

            async def ender():
                await anyio.sleep(0.02)
                ready.end()

            start(ender)
            t0 = time.monotonic()
            seen.append(await ready.wait())       # nothing to read: end() ends the wait
            seen.append(time.monotonic() - t0 < 2)
            ready.end()                           # ending when nobody waits is harmless
            start(writer)
            seen.append(await ready.wait())       # and it waits again afterwards

        aio.run_with_tasks(main)
    finally:
        os.close(read_end)
        os.close(write_end)
    assert seen == [True, False, True, True]


def test_a_cancelled_wait_for_readiness_leaves_no_reader_behind():
    import asyncio
    import os
    read_end, write_end = os.pipe()
    try:
        async def main(start):
            ready = aio.Readiness(read_end)
            with anyio.move_on_after(0.02):
                await ready.wait()
            assert not asyncio.get_running_loop().remove_reader(read_end)   # removed when the wait ended
            os.write(write_end, b"x")
            assert await ready.wait() is True

        aio.run_with_tasks(main)
    finally:
        os.close(read_end)
        os.close(write_end)
