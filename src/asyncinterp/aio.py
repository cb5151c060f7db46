"""The bridge to async applications (asyncio, trio, Jupyter): the only place that imports anyio.

(It is also the only place that imports sniffio, asyncio or trio: the rest of
asyncinterp, serving included, uses the functions here.)

``atrace`` runs the forward in a worker thread so the event loop stays free.
Cancelling the awaiting task (``anyio.fail_after``, ``asyncio.wait_for``,
trio cancel scopes) asks the run to stop at its next hook point; the awaiting
task returns only after the forward has unwound and every hook is removed,
so the model is left exactly as before. ``in_loop`` lets an intervention call
back into the event loop from inside the forward.

What serving needs (:mod:`asyncinterp.serve`):

* :func:`current_library` — ``"asyncio"`` or ``"trio"``: the library running the calling task;
* :class:`LoopHandle` — thread-safe ``call_soon`` into the calling task's event loop, and its events;
* :class:`Mailbox` — items put from any thread, awaited in the event loop that made it;
* :func:`fail_at` — raise ``TimeoutError`` at a ``time.monotonic()`` deadline (``None``: never);
* :func:`to_thread` — await a blocking call run in a worker thread;
* :func:`wait_readable` — await a descriptor that has something to read (a worker process's pipe);
* :func:`run_watched` — await ``fn()`` while a watcher runs beside it; the watcher returning first cancels it;
* :func:`run_with_tasks` / :func:`cancel_scope` — a fresh event loop with a task group, and per-task
  cancellation (the supervised worker process, :mod:`asyncinterp.serve.workers.worker_proc`);
* :func:`cancel_quietly` — cancel a scope without anyio formatting the cancelling task's repr.
"""

from __future__ import annotations

import collections
import inspect
import time

import anyio
import anyio.from_thread
import anyio.to_thread

from .kernel.traps import CallTrap, trap


async def run_in_thread(execution) -> None:
    """Wait for a started job (``execution.wait()``) in a worker thread; propagate cancellation into it."""
    box = {}
    finished = anyio.Event()

    async def worker():
        try:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(execution.wait, True)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task below
            box["exc"] = exc
        finally:
            finished.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker)
        try:
            await finished.wait()
        except anyio.get_cancelled_exc_class():
            execution.cancel()
            raise
    if "exc" in box:
        raise box["exc"]


def in_loop(fn, *args):
    """Await ``fn(*args)`` in the event loop that called ``atrace`` (sync or async ``fn``).

    The model waits meanwhile. Only possible under ``atrace``/``agenerate``:
    a plain ``trace`` has no event loop to call into.
    """

    def call():
        try:
            if inspect.iscoroutinefunction(fn):
                return anyio.from_thread.run(fn, *args)
            return anyio.from_thread.run_sync(fn, *args)
        except RuntimeError as exc:
            if "AnyIO worker thread" in str(exc) or "event loop" in str(exc):
                raise RuntimeError(
                    "ai.in_loop(...) needs an event loop: it works under `await model.atrace(...)` "
                    "(or agenerate), not under the synchronous model.trace(...)") from exc
            raise
    return trap(CallTrap(call))


# --------------------------------------------------------------------------- primitives for serving
def current_library() -> str:
    """The async library running the calling task: ``"asyncio"`` or ``"trio"`` (as sniffio names them)."""
    import sniffio
    return sniffio.current_async_library()


class LoopHandle:
    """The event loop of the task that made it: a thread-safe ``call_soon`` and the loop's own ``Event``.

    ``call_soon(fn)`` may be called from any thread; ``fn()`` then runs in the
    loop. Once the loop has finished, ``call_soon`` does nothing (nobody is
    waiting any more). Works under asyncio and trio.
    """

    __slots__ = ("call_soon", "new_event", "backend")

    def __init__(self):
        backend = current_library()
        self.backend = backend
        if backend == "asyncio":
            import asyncio
            loop = asyncio.get_running_loop()

            def call_soon(fn):
                try:
                    loop.call_soon_threadsafe(fn)
                except RuntimeError:  # the loop is closed: nobody is waiting any more
                    pass
            self.call_soon = call_soon
            self.new_event = asyncio.Event
        elif backend == "trio":
            import trio
            token = trio.lowlevel.current_trio_token()

            def call_soon(fn):
                try:
                    token.run_sync_soon(fn)
                except trio.RunFinishedError:
                    pass
            self.call_soon = call_soon
            self.new_event = trio.Event
        else:  # pragma: no cover
            raise RuntimeError(f"asyncinterp supports asyncio and trio, not {backend}")


class Mailbox:
    """Items put from any thread (``put``), awaited in the event loop that made the mailbox (``await get()``)."""

    __slots__ = ("loop", "items", "event")

    def __init__(self, loop: LoopHandle | None = None):
        self.loop = loop or LoopHandle()
        self.items = collections.deque()
        self.event = None

    def put(self, item) -> None:  # any thread
        self.items.append(item)
        self.loop.call_soon(self.wake)

    def wake(self) -> None:  # in the loop
        ev = self.event
        if ev is not None:
            ev.set()

    async def get(self):
        while not self.items:
            self.event = self.loop.new_event()
            if self.items:
                break
            await self.event.wait()
        return self.items.popleft()


def fail_at(deadline: float | None):
    """Context manager: raise ``TimeoutError`` in the block at ``deadline`` (``time.monotonic()`` seconds).

    ``None``: no limit. A deadline already past raises at the block's first wait.
    """
    return anyio.fail_after(None if deadline is None else max(deadline - time.monotonic(), 0))


async def wait_readable(obj) -> None:
    """Wait until ``obj`` (a descriptor, or an object with ``fileno()``) has something to read."""
    await anyio.wait_readable(obj)


async def to_thread(fn, *args):
    """``fn(*args)`` in a worker thread; the event loop stays free meanwhile."""
    return await anyio.to_thread.run_sync(fn, *args)


class Closable:
    """``with``, ``async with`` and ``aclose()`` for an object whose ``close()`` blocks (joins threads)."""

    def close(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        await to_thread(self.close)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()


class Watched:
    """What :func:`run_watched` found: ``stopped`` (the watcher returned first), else ``value`` or ``exc``."""

    __slots__ = ("stopped", "value", "exc")

    def __init__(self):
        self.stopped = False
        self.value = None
        self.exc = None


async def run_watched(fn, watch, catch=(Exception,)) -> Watched:
    """Await ``fn()`` while ``watch()`` runs beside it; whichever ends first cancels the other.

    If ``watch()`` returns first, ``fn()`` is cancelled and the answer has
    ``stopped=True``. Otherwise it has ``fn()``'s ``value``, or in ``exc``
    the exception of a ``catch`` type that ``fn()`` raised (caught inside the
    task group, so it comes back as raised, not in an exception group).
    """
    out = Watched()
    finished = []

    async def watcher(scope):
        await watch()
        if not finished:      # (fn() may have ended meanwhile: its scope is cancelled at the loop's next turn)
            out.stopped = True
            cancel_quietly(scope)

    async with anyio.create_task_group() as tg:
        tg.start_soon(watcher, tg.cancel_scope)
        try:
            out.value = await fn()
        except catch as exc:
            out.exc = exc
        finally:
            finished.append(True)
            cancel_quietly(tg.cancel_scope)
    return out


def cancel_quietly(scope) -> None:
    """``scope.cancel()`` (a cancel scope of this event loop), at the loop's next turn, from a callback.

    Under asyncio, anyio names the task that cancels a scope in the cancellation's reason, which formats that
    task's repr (its coroutine, its callbacks): tens of microseconds on every cancel, a few hundred with cold
    caches. A loop callback has no task to name. Under trio the scope is cancelled at once (that costs nothing).
    """
    if current_library() == "asyncio":
        import asyncio
        asyncio.get_running_loop().call_soon(scope.cancel)
    else:
        scope.cancel()


class Readiness:
    """Wait until descriptor ``fd`` has something to read, or until :meth:`end` (from this loop) ends the wait:
    one future and one reader registration, no cancel scope and no cancellation (asyncio only). A worker
    process waits on its pipe this way while requests are live, once per message, as their forwards start."""

    def __init__(self, fd: int):
        self.fd = fd
        self._fut = None

    async def wait(self) -> bool:
        """``True``: readable; ``False``: :meth:`end` was called."""
        import asyncio
        loop = asyncio.get_running_loop()
        fut = self._fut = loop.create_future()
        loop.add_reader(self.fd, _resolve, fut, True)
        try:
            return await fut
        finally:
            loop.remove_reader(self.fd)
            self._fut = None

    def end(self) -> None:
        fut = self._fut
        if fut is not None:
            _resolve(fut, False)


def _resolve(fut, value) -> None:
    if not fut.done():
        fut.set_result(value)


def run_with_tasks(main) -> None:
    """Run ``await main(start)`` in a new asyncio event loop in this thread, until it and its tasks return.

    ``start(fn, *args)`` starts ``fn(*args)`` as a task beside ``main``; the
    call returns when ``main`` and every task it started have returned. As in
    a task group, the first task that fails cancels ``main`` and the other
    tasks, and its exception is raised from this call. The tasks are plain
    asyncio tasks (cancel scopes and timeouts work in them as in any task):
    starting one costs about a third of a task group's ``start_soon``, which
    a worker process pays once per request.
    """

    async def top():
        with anyio.CancelScope() as scope:
            tasks = _Tasks(scope)
            await main(tasks.start)
        await tasks.join()
        if tasks.failure is not None:
            raise tasks.failure

    anyio.run(top)


class _Tasks:
    """The tasks :func:`run_with_tasks` started beside its ``main``; the first failure cancels everything."""

    def __init__(self, scope):
        import asyncio
        self.loop = asyncio.get_running_loop()
        self.scope = scope
        self.running = set()
        self.failure = None

    def start(self, fn, *args) -> None:
        task = self.loop.create_task(fn(*args))
        self.running.add(task)
        task.add_done_callback(self._done)

    def _done(self, task) -> None:   # a loop callback
        self.running.discard(task)
        if task.cancelled() or task.exception() is None or self.failure is not None:
            return
        self.failure = task.exception()
        self.scope.cancel()
        for other in self.running:
            other.cancel()

    async def join(self) -> None:
        import asyncio
        while self.running:
            await asyncio.wait(set(self.running))


def cancel_scope():
    """A cancel scope (``with cancel_scope() as scope: ...``; ``scope.cancel()`` from the same event loop)."""
    return anyio.CancelScope()


__all__ = ["LoopHandle", "Mailbox", "Readiness", "Watched", "cancel_quietly", "cancel_scope", "current_library",
           "fail_at", "in_loop", "run_in_thread", "run_watched", "run_with_tasks", "to_thread", "wait_readable"]
