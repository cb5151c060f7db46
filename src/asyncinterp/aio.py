"""The bridge to async applications (asyncio, trio, Jupyter): the only place that imports anyio.

``atrace`` runs the forward in a worker thread so the event loop stays free.
Cancelling the awaiting task (``anyio.fail_after``, ``asyncio.wait_for``,
trio cancel scopes) asks the run to stop at its next hook point; the awaiting
task returns only after the forward has unwound and every hook is removed,
so the model is left exactly as before. ``in_loop`` lets an intervention call
back into the event loop from inside the forward.
"""

from __future__ import annotations

import inspect

import anyio
import anyio.from_thread
import anyio.to_thread

from .kernel.traps import CallTrap, trap


async def run_in_thread(model, run) -> None:
    """Execute ``run`` in a worker thread; propagate cancellation into the forward."""
    box = {}
    finished = anyio.Event()
    run.cancellable = True

    async def worker():
        try:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(model.execute, run)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task below
            box["exc"] = exc
        finally:
            finished.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker)
        try:
            await finished.wait()
        except anyio.get_cancelled_exc_class():
            run.cancel()
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
