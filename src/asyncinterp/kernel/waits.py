"""How a parked task's wait ends: a future's callback resumes it, an abort function gives the wait up.

A task parked on a future or a sub-task registers something outside the
kernel's own tables (a done callback, a place in the sub-task's joiners);
trio's ``abort_func`` is the model: the kernel keeps, per parked task, the
function that undoes that registration without resuming it. Also here: the
test that tells an asyncio call failing for want of an event loop (the
classic foreign await) from the user's own ``RuntimeError``.
"""

from __future__ import annotations

__all__ = ["FutureWait", "abort_future", "abort_join", "raised_in_asyncio"]


class FutureWait:
    """A task parked on a Future: the done callback the kernel registers on it."""

    __slots__ = ("kernel", "task", "future")

    def __init__(self, kernel, task, future):
        self.kernel = kernel
        self.task = task
        self.future = future

    def __call__(self, fut):  # the future was set: resume the task with its outcome
        kernel, task = self.kernel, self.task
        del kernel.future_waits[task]
        exc = fut.exception()
        kernel.reschedule(task, None if exc is not None else fut.result(), exc)


def abort_future(kernel, task):
    """Give up a wait on a Future: forget the done callback."""
    wait = kernel.future_waits.pop(task)
    wait.future.remove_done_callback(wait)


def abort_join(kernel, task):
    """Give up a wait on a sub-task: leave its joiners."""
    task.waiting.task.joiners.remove(task)


def raised_in_asyncio(err) -> bool:
    """Whether ``err`` was raised inside the asyncio package.

    An intervention runs inside the model's forward pass, where no event loop
    runs: asyncio calls that need one fail there (``asyncio.sleep(1)``,
    ``asyncio.create_task`` raise ``RuntimeError`` from ``get_running_loop``).
    """
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__") or ""
    return module == "asyncio" or module.startswith("asyncio.")
