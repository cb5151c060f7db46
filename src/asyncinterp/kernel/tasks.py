"""Task combinators built on the kernel's traps: spawn, gather, steps.

None of these needs anything from the kernel beyond its traps; they are the
user-facing way to wait for several hook points at once or to walk over
generation steps.
"""

from __future__ import annotations

from .scheduler import current_task
from .traps import SpawnTrap, StepTrap, trap


def spawn(coro, name: str | None = None):
    """Start ``coro`` (a coroutine, or any of our awaitables) as a sub-task of the current intervention.

    ``handle = await ai.spawn(helper(m))`` returns at once; ``await handle``
    later gives the helper's result (or raises its error).
    """
    if not hasattr(coro, "send"):
        if hasattr(coro, "__await__") and not isinstance(coro, type):
            # a hook point, gradient point or future: wait for it in a sub-task
            return trap(SpawnTrap(_await(coro), name))
        raise TypeError(f"ai.spawn expects a coroutine object (call your async function) or an awaitable "
                        f"such as a hook point, got {coro!r}")
    return trap(SpawnTrap(coro, name))


async def _await(awaitable):
    return await awaitable


async def gather(*awaitables):
    """Wait for several awaitables (hook points, futures, coroutines) in whatever order they complete.

    Returns their results as a tuple in argument order. If one fails, the
    others are cancelled and the error propagates.
    """
    handles = []
    for i, aw in enumerate(awaitables):
        handles.append(await spawn(_await(aw), name=f"gather[{i}]"))
    results = []
    try:
        for h in handles:
            results.append(await h)
    except BaseException:
        for h in handles:
            h.cancel()
        raise
    return tuple(results)


class Steps:
    """``async for step in m.steps()``: one iteration per forward pass (generation step).

    The first iteration is the step the task is in; each later one waits for
    the next step to begin. The loop ends cleanly when the run ends, and the
    code after it runs. ``limit`` bounds the number of iterations.
    """

    __slots__ = ("_limit", "_count", "_started")

    def __init__(self, limit: int | None = None):
        self._limit = limit
        self._count = 0
        self._started = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._limit is not None and self._count >= self._limit:
            raise StopAsyncIteration
        self._count += 1
        if not self._started:
            self._started = True
            task = current_task()
            if task is None:
                raise RuntimeError("m.steps() can only be iterated inside an intervention")
            return task.step
        step = await trap(StepTrap())
        if step is None:
            raise StopAsyncIteration
        return step
