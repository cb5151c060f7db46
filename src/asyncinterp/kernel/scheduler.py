"""The scheduler: resumes intervention coroutines when hook points fire.

The model drives; the kernel follows. A hook calls ``provide(key, get_value, entry)``
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

The kernel knows nothing about torch or modules. Its host (the run; see
:class:`~asyncinterp.kernel.host.KernelHost`) supplies values through
``provide``, installs hooks lazily (``activate``), and answers whether a point
that never fired this step has nevertheless already run (``already_ran``).

Traps are dispatched by a table, ``Kernel._trap_handlers``: trap class ->
handler ``(kernel, task, trap)``, which returns ``(value, exc)`` to resume the
task at once, or ``None`` when it parked the task. A subclass (the hooks
layer's ``HookPoint`` is a ``PointTrap``) is resolved once through its MRO and
cached under its own type, so the hot path is one ``dict.get(type(trap))``.
Anything that resolves only to ``object`` is a foreign await.

A parked task records what it waits on (``task.waiting``, the trap) and how
to give the wait up (``task.abort``), in the style of trio's
``wait_task_rescheduled(abort_func)``: ``abort(kernel, task)`` undoes the
registrations the wait made elsewhere (a future's done callback, a child's
joiner list) without resuming the task. ``None`` means there is nothing to
undo: entries in the kernel's own point and step tables are dropped lazily
(one counts only while ``task.waiting`` is still its trap). Closing a task,
the end of a run or of an invoke give waits up through ``abort``; a wait that
completes goes through ``reschedule``.
"""

from __future__ import annotations

from contextvars import ContextVar

from .errors import (
    ForeignAwaitError,
    MissedHookPoint,
    OutOfOrderError,
    UnsetFutureError,
    await_site,
    without_kernel_frames,
)
from .host import KernelHost
from .task import Task, callable_name, is_async_fn
from .waits import FutureWait, abort_future, abort_join, raised_in_asyncio
from .traps import CallTrap, FutureTrap, JoinTrap, PointTrap, SpawnTrap, StepTrap

__all__ = ["Kernel", "Task", "TaskHandle", "callable_name", "current_kernel", "current_run", "current_task",
           "is_async_fn", "running_task"]

#: the task being stepped, per thread (and per context): set around every resumption, read on every await.
#: A ContextVar: reading it is a cached lookup, cheaper than a ``threading.local`` attribute.
_running = ContextVar("asyncinterp_task", default=None)
running_task = _running.get


def current_task():
    """The task being stepped on this thread, or ``None``."""
    return _running.get()


def current_kernel():
    """The kernel of the task being stepped on this thread, or ``None``."""
    task = _running.get()
    return None if task is None else task.kernel


def current_run():
    """The run hosting the task being stepped on this thread (its kernel's host), or ``None`` outside one.

    ``None`` as for :func:`current_kernel`: outside an intervention, and also
    once the run has ended (a finished kernel lets go of its host).
    """
    task = _running.get()
    kernel = None if task is None else task.kernel
    return None if kernel is None else kernel.host


class TaskHandle:
    """What ``ai.spawn`` returns: await it for the sub-task's result."""

    __slots__ = ("task",)

    def __init__(self, task):
        self.task = task

    def done(self) -> bool:
        return self.task.done

    def cancel(self) -> None:
        """Close the sub-task now (its ``finally`` blocks run); awaiting it afterwards returns None."""
        task = self.task
        if not task.done:
            kernel = current_kernel()
            if kernel is None:
                raise RuntimeError("a sub-task can only be cancelled from inside its run")
            kernel.close_task(task)
        task.observed = True

    def __await__(self):
        return (yield JoinTrap(self.task))


class Kernel:
    """Tasks, waiters and the resume loop for one run.

    The kernel owns its state: other layers read its fields (``step``,
    ``fired``, ``failures``, ...) but change them only through its methods
    (``record_failure``, ``fail``, ``request_stop``, ``set_active``,
    ``set_entry``, ``cancel_group``, the step and end methods).
    """

    def __init__(self, host: KernelHost, on_error: str = "stop"):
        self.host = host
        self.on_error = on_error
        self.step = 0
        self.fired = {}           # point key -> calls so far in this step
        self.waiters = {}         # point key -> [(task, call index, trap)]
        self.step_waiters = []
        self.future_waits = {}    # task parked on a Future -> its done callback (a FutureWait)
        self.ready = []           # (task, value, exc), first in first out
        self.tasks = []
        self.failures = []
        self.current_point = None
        self.entries = {}         # point key -> the host's entry for its firing in progress (see provide)
        self.finished = False
        self.stop_requested = False
        self.cancel_requests = []  # invoke groups to close at the next hook point (any thread may append)
        self.ended = _NONE_ENDED   # invoke groups whose run ended early (end_group), a frozenset
        self.active = None         # invoke groups taking part in the current step (None: all)
        self._closed = False

    # ------------------------------------------------------------------ tasks
    def spawn(self, coro, group, name=None, parent=None) -> Task:
        """Register a coroutine as a task; it starts at the next ``drain``.

        ``name``: a string, or an object to name the task after (the
        intervention function); by default the coroutine's name.
        """
        tasks = self.tasks
        task = Task(coro, group, (group, len(tasks) + 1), name or None, parent, self, self.step)
        tasks.append(task)
        self.ready.append((task, None, None))
        return task

    def drain(self) -> None:
        """Run every ready task (woken by a step, a future, a join, or new) until it parks or finishes."""
        ready = self.ready
        while ready:
            task, value, exc = ready.pop(0)
            if task.done:
                continue
            if task.step != self.step:
                task.step = self.step
                task.consumed = {}
                task.position = None
            if self.current_point is not None:
                task.position = self.current_point
            self._resume(task, value, exc)

    def reschedule(self, task, value=None, exc=None) -> None:
        """Resume parked ``task`` at the next ``drain``: send it ``value``, or throw ``exc`` into it.

        For a wait that completed (or that its owner ends itself): the
        registrations the wait made elsewhere must already be gone, so the
        wait's abort is dropped, not called.
        """
        task.waiting = None
        task.abort = None
        self.ready.append((task, value, exc))

    def close_task(self, task) -> None:
        """Close ``task`` now: give up its wait and run its ``finally`` blocks (on this thread).

        An exception raised while closing (a ``finally`` that raised or
        awaited again) is recorded as a failure of the run.
        """
        self._give_up(task)
        task.done = True
        task.closed = True
        token = _running.set(task)
        try:
            task.coro.close()
        except Exception as exc:  # a finally block that raised or awaited again
            exc.add_note(f"while closing intervention {task.name!r}")
            self.failures.append(exc)
        finally:
            _running.reset(token)

    def fail(self, task, exc) -> None:
        """Raise ``exc`` in ``task`` at the ``await`` it is parked on; it (and whatever it wakes) runs now.

        A task that is not parked (done, or running now) cannot be resumed:
        ``exc`` becomes its failure instead (unless it already has one or was
        closed) and a failure of the run either way.
        """
        if task.done or task.waiting is None:
            if task.exc is None and not task.closed:
                task.exc = exc
            self.failures.append(exc)
            return
        self._give_up(task)
        self.reschedule(task, None, exc)
        self.drain()

    def record_failure(self, exc) -> None:
        """Count ``exc`` as a failure of the run (one no task raised, e.g. a request the model never honoured)."""
        self.failures.append(exc)

    def request_stop(self) -> None:
        """Ask the host to stop the model after the current hook firing (``interrupted`` turns true)."""
        self.stop_requested = True

    @property
    def interrupted(self) -> bool:
        """True when the host should stop the model now."""
        return self.stop_requested or (self.on_error == "stop" and bool(self.failures))

    # --------------------------------------------------------------- firings
    def provide(self, key, get_value=None, entry=None):
        """Point ``key`` fired: resume the tasks waiting on it, each with its view of the firing.

        ``entry`` is the host's record of the firing (its value, or an object
        describing it); ``entries[key]`` holds it while the waiters run, and the
        host may replace it there with ``set_entry`` (e.g. when a task replaces the value).
        ``get_value(task, trap)`` makes each task's value; without it, a task
        gets ``entry`` itself (through ``trap.read``) as long as the host has
        not replaced it, else ``host.view_of(task, trap)``. Returns
        ``entries[key]`` as the delivery left it.
        """
        if self.cancel_requests:
            self.apply_cancels()
        fired = self.fired
        n = fired.get(key, 0)
        fired[key] = n + 1
        waiting = self.waiters.get(key)
        if waiting is None:
            return entry
        if len(waiting) == 1 and self.active is None:   # the common case: no filtering, no sort
            due = waiting
            if waiting[0][1] != n:
                return entry
            del self.waiters[key]
        else:
            due = self._take_due(key, waiting, n)
            if not due:
                return entry
        entries = self.entries
        prev_entry = entries.get(key)
        entries[key] = entry
        previous = self.current_point
        self.current_point = due[0][2]
        try:
            for task, _, trap in due:
                if task.done or task.waiting is not trap:
                    continue
                task.waiting = None  # a point wait has no abort: nothing else to reset
                if task.step != self.step:  # a wait carried over from a step its invoke sat out
                    task.step = self.step
                    task.consumed = {}
                task.consumed[key] = n + 1
                task.position = trap
                try:
                    if get_value is not None:
                        value = get_value(task, trap)
                    elif entries[key] is entry:
                        read = trap.read
                        value = entry if read is None else read(entry)
                    else:   # the host replaced the entry while an earlier waiter ran
                        value = self.host.view_of(task, trap)
                except Exception as exc:  # a view that cannot be built: the task's problem
                    self._resume(task, None, exc)
                else:
                    task.last_value = value
                    self._resume(task, value, None)
                if self.ready:
                    self.drain()
        finally:
            self.current_point = previous
            entry = entries.pop(key)
            if prev_entry is not None:
                entries[key] = prev_entry
        return entry

    def _take_due(self, key, waiting, n):
        """The waiters of ``key`` due at its call ``n`` (of the groups taking part in the step), in resume order;
        they leave ``waiters``."""
        active = self.active
        due = [e for e in waiting if e[1] == n and (active is None or e[0].group in active)]
        if not due:
            return due
        if len(due) == len(waiting):
            del self.waiters[key]
        elif active is None:
            self.waiters[key] = [e for e in waiting if e[1] != n]
        else:
            self.waiters[key] = [e for e in waiting if e[1] != n or e[0].group not in active]
        if len(due) > 1:
            due.sort(key=_order_of)
        return due

    def begin_step(self, active=None) -> None:
        """A new step (forward pass) starts: close the old one, wake step waiters.

        ``active``: the invoke groups that take part in the new step (``None``:
        all). Tasks of other groups keep waiting, on steps or on points,
        until a step their group takes part in.
        """
        if self.cancel_requests:
            self.apply_cancels()
        self._miss_points("before its step ended", self.active)
        self.step += 1
        self.fired.clear()
        self.active = active
        step = self.step
        for task in self._take_step_waiters(active):
            self.reschedule(task, step)
        self.drain()

    def set_active(self, active) -> None:
        """Name the invoke groups taking part in the current step (``None``: all), without starting a new one.

        For the first step of a host with partial steps: ``begin_step`` would
        start a second one.
        """
        self.active = active

    def set_entry(self, key, entry) -> None:
        """Replace the host's entry of point ``key``'s firing in progress (see :meth:`provide`).

        Waiters resumed after this get ``host.view_of(task, trap)`` instead of
        the entry the firing started with.
        """
        self.entries[key] = entry

    # ----------------------------------------------------------------- ending
    # Waits end in one place, _end: for the whole run (finish, end_step_loops) or
    # for one invoke (end_group). close() then closes whatever is still unfinished.

    def finish(self) -> None:
        """The model is done: end step loops, fail whatever still waits, then close what is left."""
        if self.step_waiters or self.waiters or self.future_waits or self.ready or self.cancel_requests:
            self._end(None, "before the run ended", fail_futures=True)
        else:   # the common case, once per run: nothing to cancel or wake
            self.finished = True
        self.close()

    def end_step_loops(self) -> None:
        """The run was stopped (``m.stop()``): step loops end cleanly and the code after them runs.

        Like :meth:`finish` for step waiters, but waits on points and futures
        are left for ``close`` (their tasks did not finish: the run stopped
        before their point).
        """
        self._end(None, None, fail_futures=False)

    def end_group(self, group) -> None:
        """Invoke ``group`` leaves the run early (e.g. its generation is over) while the others go on.

        For that invoke's tasks this is what ``finish`` is for all: step loops
        end cleanly (the code after them runs), waits on hook points fail with
        ``MissedHookPoint``; later awaits behave as after the end of the run.
        Waits on futures stay (another invoke may still set them).
        Call it from the model's thread, between hook firings.
        """
        self._end(frozenset((group,)), "before this invoke's run ended", fail_futures=False)

    def _end(self, groups, miss_points: str | None, fail_futures: bool) -> None:
        """End the run for invoke ``groups`` (``None``: the whole run) and run what that wakes.

        First marks them ended (``finished``, or in ``ended``; for the whole
        run, pending cancels are applied first). Then, in one sweep:

        * their step loops resume with ``None``: ``m.steps()`` stops cleanly
          and the code after the loop runs;
        * with ``miss_points`` (the "when" of the message), their waits on
          hook points fail with ``MissedHookPoint``; without, they stay for ``close``;
        * with ``fail_futures``, their waits on unset futures fail with
          ``UnsetFutureError``, in task creation order;

        then drains. One sweep settles, by construction: once marked, a task
        of these groups that awaits a step, a point, or (whole run only) an
        unset future is resumed at once with the end's outcome instead of
        parking (``_trap_step``, ``_trap_point``, ``_trap_future``), so the
        code the sweep wakes cannot leave a new wait of those kinds behind.
        Joins stay parked until their sub-task ends, or ``close`` closes them.
        """
        if groups is None:
            if self.cancel_requests:
                self.apply_cancels()
            self.finished = True
        else:
            self.ended = self.ended.union(groups)
        if not (self.step_waiters or self.waiters or self.ready or (fail_futures and self.future_waits)):
            return   # nothing waits (the common case): nothing to wake
        for task in self._take_step_waiters(groups):
            self.reschedule(task)
        if miss_points is not None:
            self._miss_points(miss_points, groups)
        if fail_futures and self.future_waits:
            self._fail_future_waits(groups)
        self.drain()

    # ------------------------------------------------------ per-invoke control
    def cancel_group(self, group) -> None:
        """Thread-safe: close every task of invoke ``group`` at the next hook point; the others go on.

        Closing runs the tasks' ``finally`` blocks on the model's thread. Only
        a list append happens here, so any thread (an event loop whose request
        was cancelled) may call it while the forward runs.
        """
        self.cancel_requests.append(group)

    def apply_cancels(self) -> None:
        """Close the tasks of the groups ``cancel_group`` asked for; call it on the model's thread.

        Does nothing while a task is executing on this thread (e.g. inside a
        backward a task started): the next hook point applies them.
        """
        if current_task() is not None:
            return
        groups = set()
        while self.cancel_requests:
            groups.add(self.cancel_requests.pop())
        for task in self.tasks:
            if task.group in groups and not task.done:
                self.close_task(task)

    def close(self) -> None:
        """Close every unfinished task (its ``finally`` blocks run) and drop waiters and the host.

        Failures of sub-tasks that nobody awaited are reported here too.
        Afterwards the kernel holds no reference cycles: it, its tasks and
        their handles are freed by reference counting.
        """
        if self._closed:
            return
        self._closed = True
        tasks = self.tasks
        for task in tasks:
            if not task.done:
                self.close_task(task)
        if self.waiters:
            self.waiters.clear()
        if self.step_waiters:
            self.step_waiters.clear()
        if self.future_waits:
            self.future_waits.clear()
        if self.ready:
            self.ready.clear()
        self.current_point = None
        self.entries.clear()
        for task in tasks:
            task.joiners = task.watch = task.last_value = task.kernel = None
            if task.exc is not None and not task.observed:
                task.observed = True
                self.failures.append(task.exc)
        self.host = None

    # ------------------------------------------------------------- internals
    def _give_up(self, task):
        """Undo ``task``'s wait (if any) through its abort; it is not resumed."""
        abort = task.abort
        if abort is not None:
            abort(self, task)
            task.abort = None
        task.waiting = None

    def _take_step_waiters(self, groups):
        """The tasks of ``groups`` (``None``: all) parked on the next step, in resume order.

        They leave ``step_waiters``; the step waits of other groups stay. An
        entry whose task no longer waits on a step (closed, or resumed
        otherwise) is dropped.
        """
        waiting = self.step_waiters
        if not waiting:
            return waiting
        if groups is None:
            self.step_waiters = []
        else:
            self.step_waiters = [t for t in waiting if t.group not in groups]
            waiting = [t for t in waiting if t.group in groups]
        due = [t for t in waiting if type(t.waiting) is StepTrap]
        due.sort(key=_task_order)
        return due

    def _miss_points(self, when: str, groups=None) -> None:
        """Fail the point waits of ``groups`` (``None``: all) with ``MissedHookPoint``: their point never ran ``when``."""
        waiters = self.waiters
        if not waiters:
            return
        if groups is None:
            entries = [e for lst in waiters.values() for e in lst]
            waiters.clear()
        else:  # only the waits of these groups end; the others carry over
            entries = []
            for key in list(waiters):
                lst = waiters[key]
                mine = [e for e in lst if e[0].group in groups]
                if mine:
                    entries.extend(mine)
                    rest = [e for e in lst if e[0].group not in groups]
                    if rest:
                        waiters[key] = rest
                    else:
                        del waiters[key]
        if entries:
            self._miss_entries(entries, when)

    def _miss_entries(self, entries, when: str) -> None:
        entries.sort(key=_order_of)
        for task, call, trap in entries:
            if task.done or task.waiting is not trap:
                continue
            nth = f" (call #{call + 1} in this pass)" if call else ""
            hint = ""
            if self.step or self.step_waiters or when.startswith("before its step"):
                hint = ("; to read a later generation step use `async for step in m.steps()`, "
                        "to read the next call of a module await the point again")
            err = MissedHookPoint(
                f"{trap.describe()}{nth}, awaited at {await_site(task.coro)}, never ran {when} "
                f"(step {self.step}){hint}{getattr(trap, 'hint', '')}")
            self.reschedule(task, None, err)

    def _fail_future_waits(self, groups):
        """Fail the waits of ``groups`` (``None``: all) on unset futures with ``UnsetFutureError``, in creation order."""
        future_waits = self.future_waits
        for task in [t for t in self.tasks if t in future_waits and (groups is None or t.group in groups)]:
            fut = future_waits[task].future
            self._give_up(task)
            where = await_site(task.coro)
            self.reschedule(task, None, UnsetFutureError(
                f"{fut!r} awaited at {where} was never set before the run ended; "
                "the task that should set it finished, failed or waits on a later point"))

    def _resume(self, task, value, exc):
        """Send ``value`` (or throw ``exc``) into ``task`` and handle its traps until it parks or ends."""
        token = _running.set(task)
        coro = task.coro
        handlers = self._trap_handlers
        watch = task.watch
        if watch is not None:
            task.watch = None   # for this resumption only
            watch.before()
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
                    if isinstance(err, RuntimeError) and raised_in_asyncio(err):
                        foreign = ForeignAwaitError(
                            f"intervention {task.name!r} used asyncio at {await_site(coro)}: interventions run "
                            "inside the model's forward pass, where no event loop runs. Use "
                            "`await ai.in_loop(fn, *args)` under atrace to run async code of your app.")
                        foreign.__cause__ = err
                        err = foreign
                    self._finish_task(task, None, err)
                    return
                handler = handlers.get(type(t))
                if handler is None:
                    handler = self._handler_for(type(t))
                resumed = handler(self, task, t)
                if resumed is None:  # parked
                    return
                value, exc = resumed
        finally:
            if watch is not None:
                try:
                    watch.after(task)
                except Exception as err:  # noqa: BLE001 - e.g. its warning turned into an error: a failure
                    self.failures.append(err)
            _running.reset(token)

    def _handler_for(self, cls):
        """The handler of trap class ``cls``: its nearest base in the table, cached under ``cls``."""
        table = self._trap_handlers
        for base in cls.__mro__:
            handler = table.get(base)
            if handler is not None:
                if base is not object:  # a foreign type is not cached: anything may be yielded
                    table[cls] = handler
                return handler
        return table[object]  # pragma: no cover - every MRO ends in object

    def has_run(self, point, task=None) -> bool:
        """Whether ``point`` already ran in this step: the one answer to "is it too late to wait for it?".

        With ``task``: whether it fired more often than ``task`` awaited it
        (its next await could only bind to a call that is over). A point that
        has not fired this step may still have run before the one firing now
        (``current_point``): the host answers from the model's order.
        :meth:`_trap_point` makes the same test inline, on the hot path.
        """
        key = point.key
        fired = self.fired.get(key, 0)
        if fired > (0 if task is None else task.consumed.get(key, 0)):
            return True
        now = self.current_point
        return fired == 0 and now is not None and now is not point and self.host.already_ran(point, now)

    # ------------------------------------------------------------ trap handlers
    # Each takes (task, trap) and returns (value, exc) to resume the task with
    # at once, or None after parking it (task.waiting, task.abort set).

    def _trap_point(self, task, trap):
        if self.ended and task.group in self.ended:
            return None, MissedHookPoint(f"{trap.describe()}, awaited at {await_site(task.coro)}, "
                                         "cannot run: this invoke's run has already ended")
        key = trap.key
        call = task.consumed.get(key, 0)
        fired = self.fired.get(key, 0)
        active = self.active
        now = self.current_point
        if active is not None and task.group not in active:
            fired = call = 0  # its invoke sits this step out: the wait is for its next step
        elif fired > call or (fired == 0 and now is not None and self.host.already_ran(trap, now)):   # has_run
            where = await_site(task.coro)
            at = task.position.describe() if task.position is not None else "the start of the pass"
            nth = f" call #{call + 1}" if call else ""
            return None, OutOfOrderError(
                f"awaited {trap.describe()}{nth} at {where}, but it already ran in this forward pass: the "
                f"intervention is at {at}, which runs after it. Await hook points in the order the model "
                f"runs them (await {trap.describe()} before {at}), or use ai.gather(...) to wait for several.")
        if self.finished:
            return None, MissedHookPoint(f"{trap.describe()}, awaited at {await_site(task.coro)}, "
                                         "cannot run: the run has already ended")
        try:
            self.host.activate(trap, task)
        except Exception as err:  # bad point for this run: raised at the user's await
            return None, err
        task.waiting = trap  # no abort: stale entries in self.waiters are skipped
        waiters = self.waiters
        entries = waiters.get(key)
        if entries is None:
            waiters[key] = [(task, call, trap)]
        else:
            entries.append((task, call, trap))
        return None

    def _trap_future(self, task, trap):
        fut = trap.future
        if fut.done():
            exc = fut.exception()
            return (None, exc) if exc is not None else (fut.result(), None)
        if self.finished:
            return None, UnsetFutureError(f"{fut!r} is not set and the run has ended")
        wait = FutureWait(self, task, fut)
        self.future_waits[task] = wait
        task.waiting = trap
        task.abort = abort_future
        fut.add_done_callback(wait)
        self._parked_holding(task)
        return None

    def _trap_step(self, task, trap):
        if self.finished or (self.ended and task.group in self.ended):
            return _RESUME_NONE
        task.waiting = trap  # no abort: stale entries in self.step_waiters are skipped
        self.step_waiters.append(task)
        return None

    def _trap_spawn(self, task, trap):
        child = self.spawn(trap.coro, task.group, trap.name, parent=task)
        return TaskHandle(child), None

    def _trap_join(self, task, trap):
        child = trap.task
        if child.done:
            return self._joined(task, child)
        task.waiting = trap
        task.abort = abort_join
        if child.joiners is None:
            child.joiners = [task]
        else:
            child.joiners.append(task)
        self._parked_holding(task)
        return None

    def _parked_holding(self, task):
        # parked on a future or a sub-task while holding the value of a point: the host may watch it
        if task.last_value is not None:
            self.host.parked_holding(task)

    def _trap_call(self, task, trap):
        try:
            return trap.fn(*trap.args), None
        except BaseException as err:  # noqa: BLE001 - thrown into the task
            return None, err

    def _trap_foreign(self, task, trap):
        return None, ForeignAwaitError(
            f"intervention {task.name!r} awaited {trap!r} at {await_site(task.coro)}, which asyncinterp "
            "cannot drive: interventions run inside the model's forward pass, not in an event loop. "
            "Await only hook points, ai.Future, ai.gather/ai.spawn handles and m.steps(); to call "
            "async code of your app from inside a run use `await ai.in_loop(fn, *args)` under atrace.")

    # trap class -> handler; subclasses are added on first use (see _handler_for).
    # ``object`` catches everything else: a foreign await.
    _trap_handlers = {
        PointTrap: _trap_point,
        FutureTrap: _trap_future,
        StepTrap: _trap_step,
        SpawnTrap: _trap_spawn,
        JoinTrap: _trap_join,
        CallTrap: _trap_call,
        object: _trap_foreign,
    }

    # ---------------------------------------------------------------- results
    def _finish_task(self, task, result, exc):
        task.done = True
        task.waiting = None
        task.abort = None
        task.result = result
        if exc is not None:
            exc = without_kernel_frames(exc)
            if task.position is not None:
                exc.add_note(f"asyncinterp: raised in intervention {task.name!r} (invoke {task.group}) "
                             f"after hook point {task.position.describe()}")
            task.exc = exc
            if task.parent is None:
                self.failures.append(exc)
        joiners = task.joiners
        if joiners:
            task.joiners = None
            for joiner in joiners:  # all still parked on this task: a join given up removes itself
                value, err = self._joined(joiner, task)
                self.reschedule(joiner, value, err)
        if task.open_loops and exc is None and not self.finished:
            # it left `async for step in m.steps()` with break (or return): tell the host, which may end the run
            self.host.left_step_loop(task)

    def _joined(self, parent, child):
        for key, n in child.consumed.items():
            if parent.consumed.get(key, 0) < n:
                parent.consumed[key] = n
        if child.exc is not None:
            child.observed = True
            return None, child.exc
        return child.result, None


_RESUME_NONE = (None, None)
_NONE_ENDED = frozenset()   # Kernel.ended until an invoke ends early


def _order_of(entry):
    return entry[0].order


def _task_order(task):
    return task.order
