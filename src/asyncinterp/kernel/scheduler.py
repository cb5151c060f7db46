"""The scheduler: resumes intervention coroutines when hook points fire.

The model drives; the kernel follows. A hook calls ``provide(key, get_value)``
and the kernel resumes, in a fixed order (invoke order, then creation order),
every task waiting on that firing, each until its next ``await``. Tasks woken
by futures that another task set during the firing run before ``provide``
returns, so the model never continues while a task could still act on the
current value.

Binding rule: inside one step (one forward pass), a task's n-th await of a
point binds to that point's n-th call. If the point already ran more often
than that, the await is out of order and fails at once. When a step ends,
tasks still waiting on its points fail with ``MissedHookPoint``; nothing ever
binds silently to a later step.

Partial steps (continuous batching, e.g. vLLM): ``begin_step(active)`` names
the invoke groups that take part in the new step. Tasks of the other groups
sit the step out: their step loops do not advance, their point waits carry
over to the group's next step instead of failing, and firings of the step do
not resume them. ``active=None`` (the default) means every group.

The kernel knows nothing about torch or modules. Its host (the run) supplies
values, installs hooks lazily (``activate``), and answers whether a point that
never fired this step has nevertheless already run (``already_ran``).
"""

from __future__ import annotations

import threading
from collections import deque

from .errors import (
    ForeignAwaitError,
    MissedHookPoint,
    OutOfOrderError,
    UnsetFutureError,
    await_site,
)
from .traps import CallTrap, FutureTrap, JoinTrap, PointTrap, SpawnTrap, StepTrap

_local = threading.local()


def current_task():
    """The task being stepped on this thread, or ``None``."""
    return getattr(_local, "task", None)


def current_kernel():
    return getattr(_local, "kernel", None)


class Task:
    """One intervention coroutine (or a sub-task of one) and its bookkeeping."""

    __slots__ = (
        "coro", "group", "order", "name", "consumed", "step", "position",
        "waiting", "done", "closed", "result", "exc", "joiners", "parent", "observed",
        "__weakref__",
    )

    def __init__(self, coro, group, order, name, parent=None):
        self.coro = coro
        self.group = group          # the invoke this task belongs to
        self.order = order          # resume order at a shared firing
        self.name = name
        self.consumed = {} if parent is None else dict(parent.consumed)
        self.step = 0 if parent is None else parent.step
        self.position = None if parent is None else parent.position
        self.waiting = None         # the trap this task is parked on
        self.done = False
        self.closed = False
        self.result = None
        self.exc = None
        self.joiners = []
        self.parent = parent
        self.observed = parent is None

    def __repr__(self):
        return f"<Task {self.name} invoke={self.group} {'done' if self.done else 'live'}>"


class TaskHandle:
    """What ``ai.spawn`` returns: await it for the sub-task's result."""

    __slots__ = ("_task",)

    def __init__(self, task):
        self._task = task

    def done(self) -> bool:
        return self._task.done

    def cancel(self) -> None:
        """Close the sub-task now (its ``finally`` blocks run); awaiting it afterwards returns None."""
        task = self._task
        if not task.done:
            kernel = current_kernel()
            if kernel is None:
                raise RuntimeError("a sub-task can only be cancelled from inside its run")
            kernel._close_task(task)
        task.observed = True

    def __await__(self):
        return (yield JoinTrap(self._task))


class Kernel:
    """Tasks, waiters and the resume loop for one run."""

    def __init__(self, host, on_error: str = "stop"):
        self.host = host
        self.on_error = on_error
        self.step = 0
        self.fired = {}           # point key -> calls so far in this step
        self.waiters = {}         # point key -> [(task, call index, trap)]
        self.step_waiters = []
        self.ready = deque()      # (task, value, exc)
        self.tasks = []
        self.failures = []
        self.current_point = None
        self.finished = False
        self.stop_requested = False
        self.cancel_requests = []  # invoke groups to close at the next hook point (any thread may append)
        self.ended = set()         # invoke groups whose run ended early (end_group)
        self.active = None         # invoke groups taking part in the current step (None: all)
        self._seq = 0
        self._closed = False

    # ------------------------------------------------------------------ tasks
    def spawn(self, coro, group, name=None, parent=None) -> Task:
        """Register a coroutine as a task; it starts at the next ``drain``."""
        self._seq += 1
        task = Task(coro, group, (group, self._seq), name or _name_of(coro), parent)
        if parent is None:
            task.step = self.step
        self.tasks.append(task)
        self.ready.append((task, None, None))
        return task

    def drain(self) -> None:
        """Run every ready task until it parks or finishes."""
        ready = self.ready
        while ready:
            task, value, exc = ready.popleft()
            if not task.done:
                self._step(task, value, exc)

    @property
    def interrupted(self) -> bool:
        """True when the host should stop the model now."""
        return self.stop_requested or (self.on_error == "stop" and bool(self.failures))

    # --------------------------------------------------------------- firings
    def provide(self, key, get_value) -> None:
        """A hook point fired: resume its waiters with ``get_value(task, trap)``."""
        if self.cancel_requests:
            self._apply_cancels()
        n = self.fired.get(key, 0)
        self.fired[key] = n + 1
        entries = self.waiters.get(key)
        if not entries:
            return
        active = self.active
        if len(entries) == 1:
            if entries[0][1] != n or (active is not None and entries[0][0].group not in active):
                return
            due = entries
            del self.waiters[key]
        else:
            due = [e for e in entries if e[1] == n and (active is None or e[0].group in active)]
            if not due:
                return
            if len(due) == len(entries):
                del self.waiters[key]
            elif active is None:
                self.waiters[key] = [e for e in entries if e[1] != n]
            else:
                self.waiters[key] = [e for e in entries if e[1] != n or e[0].group not in active]
            if len(due) > 1:
                due.sort(key=_order_of)
        previous = self.current_point
        self.current_point = due[0][2]
        try:
            for task, _, trap in due:
                if task.done or task.waiting is not trap:
                    continue
                task.waiting = None
                if task.step != self.step:  # a wait carried over from a step its invoke sat out
                    task.step = self.step
                    task.consumed = {}
                task.consumed[key] = n + 1
                task.position = trap
                try:
                    value = get_value(task, trap)
                except Exception as exc:  # a view that cannot be built: the task's problem
                    self._step(task, None, exc)
                else:
                    self._step(task, value, None)
                if self.ready:
                    self.drain()
        finally:
            self.current_point = previous

    def begin_step(self, active=None) -> None:
        """A new step (forward pass) starts: close the old one, wake step waiters.

        ``active``: the invoke groups that take part in the new step (``None``:
        all). Tasks of other groups keep waiting, on steps or on points,
        until a step their group takes part in.
        """
        if self.cancel_requests:
            self._apply_cancels()
        self._miss_points("before its step ended", self.active)
        self.step += 1
        self.fired.clear()
        self.active = active
        waiting, self.step_waiters = self.step_waiters, []
        if active is not None:
            self.step_waiters = [t for t in waiting if t.group not in active]
            waiting = [t for t in waiting if t.group in active]
        waiting.sort(key=lambda t: t.order)
        for task in waiting:
            if task.waiting is not None and not task.done:
                task.waiting = None
                self.ready.append((task, self.step, None))
        self.drain()

    def finish(self) -> None:
        """The model is done: end step loops, fail whatever still waits."""
        if self.cancel_requests:
            self._apply_cancels()
        self.finished = True
        for _ in range(1000):
            woke = False
            waiting, self.step_waiters = self.step_waiters, []
            for task in sorted(waiting, key=lambda t: t.order):
                if not task.done:
                    task.waiting = None
                    self.ready.append((task, None, None))
                    woke = True
            woke |= self._miss_points("before the run ended")
            for task in self.tasks:
                if not task.done and isinstance(task.waiting, FutureTrap):
                    fut = task.waiting.future
                    fut._remove_waiter(task)
                    task.waiting = None
                    where = await_site(task.coro)
                    self.ready.append((task, None, UnsetFutureError(
                        f"{fut!r} awaited at {where} was never set before the run ended; "
                        "the task that should set it finished, failed or waits on a later point")))
                    woke = True
            self.drain()
            if not woke:
                break
        self.close()

    # ------------------------------------------------------ per-invoke control
    def cancel_group(self, group) -> None:
        """Thread-safe: close every task of invoke ``group`` at the next hook point; the others go on.

        Closing runs the tasks' ``finally`` blocks on the model's thread. Only
        a list append happens here, so any thread (an event loop whose request
        was cancelled) may call it while the forward runs.
        """
        self.cancel_requests.append(group)

    def _apply_cancels(self):
        if current_task() is not None:  # a task is executing on this thread (e.g. inside a backward): later
            return
        groups = set()
        while self.cancel_requests:
            groups.add(self.cancel_requests.pop())
        for task in self.tasks:
            if task.group in groups and not task.done:
                self._close_task(task)

    def end_group(self, group) -> None:
        """Invoke ``group`` leaves the run early (e.g. its generation is over) while the others go on.

        For that invoke's tasks this is what ``finish`` is for all: step loops
        end cleanly (the code after them runs), waits on hook points fail with
        ``MissedHookPoint``; later awaits behave as after the end of the run.
        Call it from the model's thread, between hook firings.
        """
        self.ended.add(group)
        for _ in range(1000):
            woke = False
            keep = []
            for task in sorted(self.step_waiters, key=lambda t: t.order):
                if task.group == group and not task.done:
                    task.waiting = None
                    self.ready.append((task, None, None))
                    woke = True
                elif task.group != group:
                    keep.append(task)
            self.step_waiters = keep
            mine = []
            for key in list(self.waiters):
                entries = self.waiters[key]
                if any(e[0].group == group for e in entries):
                    mine.extend(e for e in entries if e[0].group == group)
                    rest = [e for e in entries if e[0].group != group]
                    if rest:
                        self.waiters[key] = rest
                    else:
                        del self.waiters[key]
            if mine:
                woke |= self._miss_entries(mine, "before this invoke's run ended")
            self.drain()
            if not woke:
                break

    def close(self) -> None:
        """Close every unfinished task (its ``finally`` blocks run) and drop waiters.

        Failures of sub-tasks that nobody awaited are reported here too.
        """
        if self._closed:
            return
        self._closed = True
        for task in self.tasks:
            if not task.done:
                self._close_task(task)
        self.waiters.clear()
        self.step_waiters.clear()
        self.ready.clear()
        for task in self.tasks:
            if task.exc is not None and not task.observed:
                task.observed = True
                self.failures.append(task.exc)

    def _close_task(self, task):
        if isinstance(task.waiting, FutureTrap):
            task.waiting.future._remove_waiter(task)
        task.waiting = None
        task.done = True
        task.closed = True
        prev = _enter(self, task)
        try:
            task.coro.close()
        except Exception as exc:  # a finally block that raised or awaited again
            exc.add_note(f"while closing intervention {task.name!r}")
            self.failures.append(exc)
        finally:
            _leave(prev)

    # ------------------------------------------------------------- internals
    def _miss_points(self, when: str, groups=None) -> bool:
        if not self.waiters:
            return False
        if groups is not None:  # only the waits of these groups' step end; the others carry over
            entries = []
            for key in list(self.waiters):
                lst = self.waiters[key]
                mine = [e for e in lst if e[0].group in groups]
                if mine:
                    entries.extend(mine)
                    rest = [e for e in lst if e[0].group not in groups]
                    if rest:
                        self.waiters[key] = rest
                    else:
                        del self.waiters[key]
            return self._miss_entries(entries, when) if entries else False
        entries = [e for lst in self.waiters.values() for e in lst]
        self.waiters.clear()
        self._miss_entries(entries, when)
        return True

    def _miss_entries(self, entries, when: str) -> bool:
        entries.sort(key=_order_of)
        woke = False
        for task, call, trap in entries:
            if task.done or task.waiting is not trap:
                continue
            task.waiting = None
            nth = f" (call #{call + 1} in this pass)" if call else ""
            hint = ""
            if self.step or self.step_waiters or when.startswith("before its step"):
                hint = ("; to read a later generation step use `async for step in m.steps()`, "
                        "to read the next call of a module await the point again")
            err = MissedHookPoint(
                f"{trap.describe()}{nth}, awaited at {await_site(task.coro)}, never ran {when} "
                f"(step {self.step}){hint}")
            self.ready.append((task, None, err))
            woke = True
        return woke

    def _future_done(self, task, fut):
        if task.waiting is not None and isinstance(task.waiting, FutureTrap) and task.waiting.future is fut:
            task.waiting = None
            if fut._exc is not None:
                self.ready.append((task, None, fut._exc))
            else:
                self.ready.append((task, fut._value, None))

    def _step(self, task, value, exc):
        """Resume ``task`` and handle traps until it parks or ends."""
        prev = _enter(self, task)
        if task.step != self.step:
            task.step = self.step
            task.consumed = {}
            task.position = None
        if self.current_point is not None:
            task.position = self.current_point
        coro = task.coro
        try:
            while True:
                try:
                    if exc is None:
                        t = coro.send(value)
                    else:
                        t = coro.throw(exc)
                except StopIteration as stop:
                    self._finish_task(task, stop.value, None)
                    return
                except BaseException as err:  # noqa: BLE001 - tasks may raise anything
                    if isinstance(err, RuntimeError) and "no running event loop" in str(err):
                        foreign = ForeignAwaitError(
                            f"intervention {task.name!r} used asyncio at {await_site(coro)}: interventions run "
                            "inside the model's forward pass, where no event loop runs. Use "
                            "`await ai.in_loop(fn, *args)` under atrace to run async code of your app.")
                        foreign.__cause__ = err
                        err = foreign
                    self._finish_task(task, None, err)
                    return
                value = exc = None
                if isinstance(t, PointTrap):
                    exc = self._wait_point(task, t)
                    if exc is None:
                        return
                elif isinstance(t, FutureTrap):
                    fut = t.future
                    if fut.done():
                        if fut._exc is not None:
                            exc = fut._exc
                        else:
                            value = fut._value
                    elif self.finished:
                        exc = UnsetFutureError(f"{fut!r} is not set and the run has ended")
                    else:
                        task.waiting = t
                        fut._add_waiter(self, task)
                        return
                elif isinstance(t, StepTrap):
                    if self.finished or (self.ended and task.group in self.ended):
                        value = None
                    else:
                        task.waiting = t
                        self.step_waiters.append(task)
                        return
                elif isinstance(t, SpawnTrap):
                    child = self.spawn(t.coro, task.group, t.name, parent=task)
                    value = TaskHandle(child)
                elif isinstance(t, JoinTrap):
                    child = t.task
                    if child.done:
                        value, exc = self._joined(task, child)
                    else:
                        task.waiting = t
                        child.joiners.append(task)
                        return
                elif isinstance(t, CallTrap):
                    try:
                        value = t.fn(*t.args)
                    except BaseException as err:  # noqa: BLE001
                        exc = err
                else:
                    exc = ForeignAwaitError(
                        f"intervention {task.name!r} awaited {t!r} at {await_site(coro)}, which asyncinterp "
                        "cannot drive: interventions run inside the model's forward pass, not in an event loop. "
                        "Await only hook points, ai.Future, ai.gather/ai.spawn handles and m.steps(); to call "
                        "async code of your app from inside a run use `await ai.in_loop(fn, *args)` under atrace.")
        finally:
            _leave(prev)

    def _wait_point(self, task, trap):
        if self.ended and task.group in self.ended:
            return MissedHookPoint(f"{trap.describe()}, awaited at {await_site(task.coro)}, "
                                   "cannot run: this invoke's run has already ended")
        key = trap.key
        call = task.consumed.get(key, 0)
        fired = self.fired.get(key, 0)
        if self.active is not None and task.group not in self.active:
            fired = call = 0  # its invoke sits this step out: the wait is for its next step
        elif fired > call or (fired == 0 and self.current_point is not None
                              and self.host.already_ran(trap, self.current_point)):
            where = await_site(task.coro)
            at = task.position.describe() if task.position is not None else "the start of the pass"
            nth = f" call #{call + 1}" if call else ""
            return OutOfOrderError(
                f"awaited {trap.describe()}{nth} at {where}, but it already ran in this forward pass: the "
                f"intervention is at {at}, which runs after it. Await hook points in the order the model "
                f"runs them (await {trap.describe()} before {at}), or use ai.gather(...) to wait for several.")
        if self.finished:
            return MissedHookPoint(f"{trap.describe()}, awaited at {await_site(task.coro)}, "
                                   "cannot run: the run has already ended")
        try:
            self.host.activate(trap, task)
        except Exception as err:  # bad point for this run: raised at the user's await
            return err
        task.waiting = trap
        entries = self.waiters.get(key)
        if entries is None:
            self.waiters[key] = [(task, call, trap)]
        else:
            entries.append((task, call, trap))
        return None

    def _finish_task(self, task, result, exc):
        task.done = True
        task.waiting = None
        task.result = result
        if exc is not None:
            if task.position is not None:
                exc.add_note(f"asyncinterp: raised in intervention {task.name!r} (invoke {task.group}) "
                             f"after hook point {task.position.describe()}")
            task.exc = exc
            if task.parent is None:
                self.failures.append(exc)
        for joiner in task.joiners:
            if joiner.waiting is not None and isinstance(joiner.waiting, JoinTrap):
                joiner.waiting = None
                value, err = self._joined(joiner, task)
                self.ready.append((joiner, value, err))
        task.joiners = []

    def _joined(self, parent, child):
        for key, n in child.consumed.items():
            if parent.consumed.get(key, 0) < n:
                parent.consumed[key] = n
        if child.exc is not None:
            child.observed = True
            return None, child.exc
        return child.result, None


def _order_of(entry):
    return entry[0].order


def _name_of(coro) -> str:
    return getattr(coro, "__qualname__", None) or getattr(coro, "__name__", None) or repr(coro)


def _enter(kernel, task):
    prev = (getattr(_local, "kernel", None), getattr(_local, "task", None))
    _local.kernel = kernel
    _local.task = task
    return prev


def _leave(prev):
    _local.kernel, _local.task = prev
