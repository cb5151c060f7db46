"""Task combinators built on the kernel's traps: spawn, gather, steps.

None of these needs anything from the kernel beyond its traps; they are the
user-facing way to wait for several hook points at once or to walk over
generation steps.
"""

from __future__ import annotations

from .errors import user_site
from .scheduler import current_task
from .traps import SpawnTrap, StepTrap, trap


def spawn(coro, name: str | None = None):
    """Start ``coro`` (a coroutine, or any of our awaitables) as a sub-task of the current intervention.

    ``handle = await ai.spawn(helper(m))`` returns at once; ``await handle``
    later gives the helper's result (or raises its error).
    """
    if not hasattr(coro, "send"):
        if hasattr(coro, "__await__") and not isinstance(coro, type):
            # a hook point, gradient point or future: wait for it in a sub-task named after it
            return trap(SpawnTrap(_await(coro, user_site(2)), name or f"spawn({_describe(coro)})"))
        raise TypeError(f"ai.spawn expects a coroutine object (call your async function) or an awaitable "
                        f"such as a hook point, got {coro!r}")
    return trap(SpawnTrap(coro, name))


async def _await(awaitable, __ai_site__=None):
    # __ai_site__: the user's line that made this sub-task (await_site reports it)
    return await awaitable


def _describe(awaitable) -> str:
    describe = getattr(awaitable, "describe", None)
    return describe() if callable(describe) else repr(awaitable)


async def gather(*awaitables):
    """Wait for several awaitables (hook points, futures, coroutines) in whatever order they complete.

    Returns their results as a tuple in argument order. If one fails, the
    others are cancelled and the error propagates.
    """
    handles = []
    site = user_site(2)
    for i, aw in enumerate(awaitables):
        handles.append(await spawn(_await(aw, site), name=f"gather[{i}] {_describe(aw)}"))
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

    Step numbers count forward passes from 0 (the prompt pass of a
    generation). ``Steps(stop)`` / ``Steps(start, stop)`` take ``range``'s
    arguments: the loop yields the steps ``start <= step < stop`` (waiting
    for ``start`` without yielding earlier ones) and ends after ``stop - 1``
    without waiting for another step. The first iteration is the step the
    task is in (if it is in range); each later one waits for the next step to
    begin. The loop ends cleanly when the run ends, and the code after it runs.
    """

    __slots__ = ("_start", "_stop", "_started", "_task")

    def __init__(self, start: int | None = None, stop: int | None = None):
        if stop is None:
            start, stop = 0, start
        self._start = 0 if start is None else start
        self._stop = stop
        if self._start < 0 or (stop is not None and stop < 0):
            raise ValueError(f"m.steps({start}, {stop}): step numbers start at 0 (the first forward pass)")
        self._started = False
        self._task = None

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._started:
            self._started = True
            task = current_task()
            if task is None:
                raise RuntimeError("m.steps() can only be iterated inside an intervention")
            self._task = task
            task.open_loops += 1
            step = task.step
        else:
            step = await self._next()
        while step is not None and step < self._start:
            step = await self._next()
        if step is None or (self._stop is not None and step >= self._stop):
            self._end()
            raise StopAsyncIteration
        return step

    async def _next(self):
        if self._stop is not None and self._task.step + 1 >= self._stop:
            return None   # the next step is out of range: end now, in the current step
        return await trap(StepTrap())

    def _end(self):
        task, self._task = self._task, None
        if task is not None:
            task.open_loops -= 1
