"""Where an invoke's results go: the object ``tr.invoke(...)`` returns.

An :class:`Invoke` is the result carrier of one invoke of a job: it is made
when the invoke is added (so ``with model.trace() as tr: p = tr.invoke(...)``
can hand it out before anything ran), the run that executes the job records
the invoke's tasks in it, and afterwards it answers ``result``. While the
job runs it also reaches that run, for ``cancel()`` from another thread and,
for generations, the tokens produced so far.
"""

from __future__ import annotations

import inspect
import weakref

import torch

from .kernel.errors import AsyncInterpError, RunCancelled
from .kernel.futures import Future
from .kernel.traps import PointTrap

__all__ = ["PLAIN_RESULTS", "Invoke", "RunStopped", "forgotten_await"]


class RunStopped(AsyncInterpError):
    """Reading the result of an invoke whose task did not finish because the run was stopped early."""


class Invoke:
    """One invoke of a job: the interventions' tasks once it runs, and their results."""

    #: whether this invoke still needs its run after the run is over (generation results are read from it);
    #: otherwise the run is held weakly once done, so a finished run is freed by reference counting alone
    keeps_run = False

    def __init__(self, index, spec):
        self.index = index
        self.spec = spec          # the job's InvokeSpec
        self.tasks = []
        self._run = None

    # defaults, set on the instance when they change
    cancelled = False
    done = False              # set when the run is over

    @property
    def input(self):
        return self.spec.input

    @property
    def fns(self) -> tuple:
        return self.spec.fns

    @property
    def kwargs(self):
        return self.spec.kwargs

    @property
    def background(self) -> bool:
        return self.spec.background

    @property
    def run(self):
        """The run executing (or that executed) this invoke; ``None`` before it starts or once it is freed."""
        run = self._run
        return run() if isinstance(run, weakref.ref) else run

    def bind(self, run) -> None:
        """The run that executes this invoke starts (called by the run)."""
        self._run = run

    def finish(self, run_ref=None) -> None:
        """The run is over: results are final (called by the run with a weak reference to itself)."""
        self.done = True
        if self.keeps_run:
            return
        if run_ref is None:
            run = self._run
            run_ref = run if run is None or type(run) is weakref.ref else weakref.ref(run)
        self._run = run_ref

    def cancel(self) -> None:
        """Thread-safe: close this invoke's interventions at the model's next hook point.

        The other invokes of the run, and the forward itself, go on; this
        invoke's ``result`` then raises ``RunCancelled``. Before the run starts,
        the invoke starts cancelled. (``run.cancel()`` stops the whole run instead.)
        """
        if self.done:   # too late: it finished; keep its result
            return
        self.cancelled = True
        run = self.run
        if run is not None and not run.done:
            run.cancel_invoke(self.index)

    @property
    def result(self):
        """The intervention's return value (a tuple if the invoke has several)."""
        if not self.done:
            raise RuntimeError("the run has not been executed yet; leave the `with model.trace()` block or call tr.run()")
        return self.value()

    def value(self):
        """The result as it stands now, without requiring the run to be over (an invoke that left a run early).

        Raises ``RunCancelled`` for a cancelled invoke, ``RunStopped`` for an
        intervention that did not finish, or the intervention's own error.
        ``None`` for an invoke without interventions.
        """
        if self.cancelled:
            raise RunCancelled(f"invoke {self.index} was cancelled (Invoke.cancel); the other invokes of its run went on")
        tasks = self.tasks
        for t in tasks:
            if not t.done or t.closed:
                raise RunStopped(f"intervention {t.name!r} of invoke {self.index} did not finish: the run stopped early")
            if t.exc is not None:
                raise t.exc
        if len(tasks) == 1:
            return tasks[0].result
        return tuple([t.result for t in tasks]) if tasks else None

    def __repr__(self):
        state = "done" if self.done else "not run"
        return f"<{type(self).__name__} {self.index} ({state})>"


def forgotten_await(task):
    """A ``TypeError`` if ``task`` finished returning an awaitable of ours (an ``await`` is missing), else ``None``."""
    result = task.result
    if result is None or type(result) in PLAIN_RESULTS or not task.done or task.closed or task.exc is not None:
        return None
    return _forgot_await_error(task, result) if _forgot_await(result) else None


def _forgot_await(value) -> bool:
    if isinstance(value, (PointTrap, Future)) or inspect.iscoroutine(value):
        return True
    if type(value) in (tuple, list):
        for v in value:
            if type(v) not in _PLAIN_ITEMS and (isinstance(v, (PointTrap, Future)) or inspect.iscoroutine(v)):
                return True
    return False


#: result types that cannot be a forgotten await (checked without isinstance)
PLAIN_RESULTS = frozenset((torch.Tensor, int, float, bool, str, bytes, dict))
#: the same for the items of a returned tuple or list (only one level is checked: a nested tuple is plain)
_PLAIN_ITEMS = PLAIN_RESULTS | {tuple, list, type(None)}


def _forgot_await_error(task, value) -> TypeError:
    items = value if type(value) in (tuple, list) else (value,)
    for v in items:
        if inspect.iscoroutine(v):
            v.close()   # no "never awaited" warning on top of this error
    what = ", ".join(repr(v) for v in items if isinstance(v, (PointTrap, Future)) or inspect.iscoroutine(v))
    return TypeError(
        f"intervention {task.name!r} returned {what} instead of its value: an `await` is missing "
        "(write `return await m.x.output`, not `return m.x.output`)")
