"""One run: the kernel's host while a model executes.

A run owns a kernel, the hooks it installs, the layout of the batch and the
firings in progress. It turns each torch hook call into ``kernel.provide``,
applies the tasks' replacements, stops the model when asked (stop, failure,
cancellation) and, whatever happens, removes every hook and drops every
reference it took before it returns.
"""

from __future__ import annotations

import inspect
import weakref
from functools import partial
from types import CoroutineType

import torch

from .kernel.errors import (
    MissedHookPoint,
    NotInRunError,
    OutOfOrderError,
    RunCancelled,
    await_site,
)
from .hooks.modules import (
    HookSet,
    instance_forward,
    set_instance_forward,
    submodules,
)
from .hooks.batching import batch_inputs, forward_kwargs
from .hooks.callers import QUIET_THREADS, call_quietly, get_ident, is_quiet
from .hooks.keywords import check_forward_kwargs
from .hooks.firing import Firing, StaleEditWarning, StaleWatch
from .hooks.views import WHOLE_BATCH, Layout
from .invoke import PLAIN_RESULTS, Invoke, RunStopped, forgotten_await
from .job import LateBindingError, check_intervention, is_async_fn
from .kernel.scheduler import Kernel, callable_name, current_task

# Invoke, RunStopped, LateBindingError, check_intervention and is_async_fn lived here before jobs: still importable
__all__ = ["EVENTS", "Firing", "Invoke", "LateBindingError", "Run", "RunStopped", "StaleEditWarning", "StopForward",
           "check_intervention", "is_async_fn"]

#: ``run.context`` key of a list of ``(invoke index, event)`` pairs that a run's host hands to its caller
#: as they are produced (the vLLM engine loop streams them out of worker processes, e.g. ``serve.emit``)
EVENTS = "run.events"


class StopForward(BaseException):
    """Raised through the model's forward to stop it now (not an Exception, so model code cannot catch it).

    Hooks of a run raise it when the run must stop (``m.stop()``, a failure,
    cancellation); ``Run.execute`` catches it. Hosts that drive the forward
    themselves (vLLM's worker) catch it around their own hooks.
    """


class Run:
    """The kernel's host while one job's forward pass (or generation) executes.

    An engine makes it from a frozen :class:`~asyncinterp.job.Job` (the job's
    result carriers are its ``invokes``) and ``wait()`` runs it. It implements
    the run interface (:class:`asyncinterp.hooks.host.RunHost`): the only
    surface points, tools, the vLLM worker and serving use. See
    docs/design.md, "The run interface". Subclasses (language models) say how
    the job's inputs become a forward call (:meth:`prepare`).
    """

    #: invokes that called m.stop() under stop_per_invoke (a set once one has)
    stopped_invokes = frozenset()

    def __init__(self, model, job, layout: Layout | None = None):
        # Containers an empty run does not need are made on first use (None until then).
        self.model = model                 # the root envoy (a Model)
        self.job = job
        self.layout = layout or WHOLE_BATCH
        self.on_error = job.on_error
        self.stop_per_invoke = job.stop_per_invoke   # m.stop() ends only the caller's invoke (serving)
        self.stepping = False              # the run has steps (generation): leaving m.steps() early may end it
        self.invokes = job.results         # the result carriers (each bound to this run when it starts)
        self.kernel = None
        self.done = False
        self.output = None
        self.stopped = False
        self.cancelled = False
        self.cancellable = False           # add cancellation checkpoints (wait(cancellable=True): aio, serving)
        context = job.context
        self._context = dict(context) if context else None   # values for interventions and tools (``context``)
        self._handles = []                 # what cleanup removes, in reverse order
        self._hooks = None                 # the module hooks this run wrote (a HookSet, also in _handles)
        self._installed = _NO_POINTS       # point keys hooked in this run (a set once one is)
        self._kept = _NO_POINTS            # modules given a keep-alive pre-hook (a set once one is)
        self._skips = None                 # module -> [(invoke, value, what)] replacing its next output
        self._thread = None                # the thread executing this run's forward (set by start)
        self._taps = None                  # point key -> callbacks seeing each firing's final value
        self._pending_skips = None         # forward swaps of skip(), to check they were applied
        self._attached_caller = None       # the invoke calling an attached module right now
        self._state = None                 # owner -> per-run state (Run.state)

    @property
    def context(self) -> dict:
        """Values for this run's interventions and tools (serving: its requests); made on first use."""
        context = self._context
        if context is None:
            context = self._context = {}
        return context

    # ------------------------------------------------------------ executing a job
    def prepare(self):
        """Set the run's layout from the job's inputs; return the callable that runs the forward pass.

        The default: the invokes' inputs batched along dim 0 (``hooks.batching``) into one call of the module.
        """
        invokes = self.invokes
        args, kwargs, layout = batch_inputs([inv.spec.input for inv in invokes])
        self.layout = layout
        module = self.model.module
        extra = forward_kwargs(invokes)
        if extra:
            check_forward_kwargs(module, extra)
            kwargs = {**kwargs, **extra}
        return partial(module, *args, **kwargs)

    def wait(self, cancellable: bool = False, around=None) -> None:
        """Run the job: prepare the forward, execute it, raise the failures (``on_error="stop"``).

        ``cancellable``: :meth:`cancel` may come from another thread meanwhile (adds checkpoints).
        ``around(forward)``: a wrapper of the forward callable (a scan runs it with fake tensors).
        """
        if self.done:
            raise RuntimeError("this run has already executed; submit the job again for a new run")
        self.cancellable = cancellable
        forward = self.prepare()
        self.execute(forward if around is None else around(forward))

    def cancel_invoke(self, index) -> None:
        """Thread-safe: close invoke ``index``'s interventions at the next hook point (``Invoke.cancel``)."""
        kernel = self.kernel
        if kernel is not None:
            kernel.cancel_group(index)

    # ------------------------------------------------ run interface: points
    def activate(self, trap, task) -> None:
        """Kernel host: the first wait on ``trap``; the point installs itself (``trap.activate_in``)."""
        if trap.key not in self._installed:   # a module point already hooked in this run: nothing to do
            trap.activate_in(self, task)

    def _hook_set(self) -> HookSet:
        """The module hooks of this run (made, with the sets that track them, by the first hook)."""
        hooks = self._hooks
        if hooks is None:
            hooks = self._hooks = HookSet()
            self._installed = set()
            self._kept = set()
            self._handles.append(hooks)
        return hooks

    def install_point(self, point) -> None:
        """Install the torch hook of a module point (base ``.output`` / ``.inputs``); idempotent."""
        if point in self._installed:
            return
        hooks = self._hooks
        if hooks is None:
            hooks = self._hook_set()
        envoy = point.envoy
        if point.base_kind == "output":
            hook = self.output_hook(point)
            if envoy.attached:
                hook = self._for_invoke(hook, envoy.invoke)
            hooks.forward(envoy.module, hook)
        else:
            hook = self.input_hook(point)
            if envoy.attached:
                hook = self._for_invoke(hook, envoy.invoke)
            hooks.pre(envoy.module, hook, True)
        self._installed.add(point)
        parent = envoy.parent
        if parent is not None and (parent.module not in self._kept or self.cancellable):
            self.keep_ancestors(envoy)

    def keep_alive(self, module) -> None:
        """Make ``module`` take torch's hooked path in this run (a no-op pre-hook, also the cancel checkpoint)."""
        if module not in self._kept:
            hooks = self._hook_set()
            self._kept.add(module)
            hooks.pre(module, self._keepalive)

    def keep_ancestors(self, envoy) -> None:
        """``keep_alive`` every ancestor of ``envoy``.

        A hook added while a module is already running only fires if that
        module took torch's hooked path, i.e. had some hook when it started.
        """
        e = envoy.parent
        while e is not None and e.module not in self._kept:
            self.keep_alive(e.module)
            e = e.parent
        if self.cancellable:
            # async runs: siblings along the path check for cancellation too, so
            # a cancel lands at the next layer rather than at the awaited point
            e = envoy
            while e.parent is not None:
                for sibling in submodules(e.parent.module).values():
                    if sibling is not None:
                        self.keep_alive(sibling)
                e = e.parent

    def _for_invoke(self, hook, group):
        """A hook of an attached module's point that fires only for calls made by invoke ``group``."""
        def attached_hook(module, *rest):
            if self._attached_caller != group:
                return None
            return hook(module, *rest)
        return attached_hook

    def _keepalive(self, module, args):
        if self.cancelled and get_ident() == self._thread:
            raise StopForward()

    def already_ran(self, trap, current_point) -> bool:
        """Kernel host: has ``trap`` run already in this pass, the model being at ``current_point``?"""
        order = self.model.call_order
        return order is not None and order.ran_before(trap, current_point)

    # --------------------------------------------- run interface: lifetime
    def on_cleanup(self, handle) -> None:
        """``handle.remove()`` is called when the run ends (success or failure), in reverse order."""
        self._handles.append(handle)

    def state(self, owner, factory=dict):
        """Per-run storage of ``owner`` (a class, function, module or object), made by ``factory()`` on first use."""
        states = self._state
        if states is None:
            states = self._state = {}
        st = states.get(owner)
        if st is None:
            st = states[owner] = factory()
        return st

    # ---------------------------------------------- run interface: firings
    def firing(self, key):
        """The :class:`Firing` of point ``key`` in progress (the model is inside it), or ``None``."""
        kernel = self.kernel
        entry = kernel.entries.get(key) if kernel is not None else None
        if entry is None or type(entry) is Firing:
            return entry
        return self._upgrade(key, entry)

    def in_firing(self, key) -> bool:
        """Whether point ``key`` is firing now (the model is inside it)."""
        kernel = self.kernel
        return kernel is not None and key in kernel.entries

    def _upgrade(self, key, value) -> Firing:
        # A module point of a whole-batch run fires with its bare value as the kernel's entry (no Firing is
        # made unless somebody needs one: a replacement, or a caller of firing()); make it now.
        firing = Firing(key, value, self.layout)
        self.kernel.set_entry(key, firing)
        return firing

    def view_of(self, task, trap):
        """Kernel host: ``task``'s value at ``trap`` once a bare-value firing was upgraded (see ``Kernel.provide``)."""
        entry = self.kernel.entries[trap.key]
        if type(entry) is Firing:
            return entry.view_for(task, trap)
        read = trap.read
        return entry if read is None else read(entry)

    @property
    def in_adhoc_call(self) -> bool:
        """True while a module call in progress must reach none of this run's points: an ad hoc call, or a
        call made on another thread than the one executing this run (see :mod:`.hooks.callers`)."""
        return is_quiet(self._thread)

    def _interrupt(self) -> None:
        """After a delivery that left a failure, a stop or a cancel: raise ``StopForward`` if the model must stop now."""
        if self.kernel.interrupted or self.cancelled:
            raise StopForward()

    def _tapped(self, key, final) -> None:
        taps = self._taps.get(key)
        if taps is not None:
            for tap in taps:
                tap(final)

    def output_hook(self, point):
        """The forward hook that delivers module point ``point`` (subclasses may wrap it)."""
        def hook(module, args, output):
            ident = get_ident()
            if ident != self._thread or ident in QUIET_THREADS:
                return None
            layout = self.layout
            kernel = self.kernel
            if type(layout) is Layout and output is not None and not self._skips:
                # the bare value: a Firing is made only if a task replaces it (see _upgrade)
                entry = kernel.provide(point, None, output)
            else:
                entry = Firing(point, output, layout)
                if self._skips:
                    skips = self._skips.pop(module, None)
                    if skips:
                        for group, value, _ in skips:
                            entry.replace(group, point, value)
                entry = kernel.provide(point, entry.view_for, entry)
            if kernel.failures or kernel.stop_requested or self.cancelled:
                self._interrupt()
            # ``entry`` is the bare output unless a replacement upgraded it to a Firing (see _upgrade)
            result = None if entry is output else entry.result()
            if self._taps:
                self._tapped(point, output if result is None else result)
            return result
        return hook

    def input_hook(self, point):
        """The forward pre-hook (with kwargs) that delivers module point ``point`` (subclasses may wrap it)."""
        def hook(module, args, kwargs):
            ident = get_ident()
            if ident != self._thread or ident in QUIET_THREADS:
                return None
            layout = self.layout
            kernel = self.kernel
            value = (args, kwargs)
            if type(layout) is Layout:   # see output_hook
                entry = kernel.provide(point, None, value)
            else:
                entry = Firing(point, value, layout)
                entry = kernel.provide(point, entry.view_for, entry)
            if kernel.failures or kernel.stop_requested or self.cancelled:
                self._interrupt()
            new = None if entry is value else entry.result()
            if self._taps:
                self._tapped(point, value if new is None else new)
            if new is None:
                return None
            new_args, new_kwargs = new
            return tuple(new_args), dict(new_kwargs)
        return hook

    def tap(self, point, callback) -> None:
        """Call ``callback(value)`` after every firing of base point ``point`` in this run.

        ``value`` is the full (batched) value as the model continues with it,
        after the firing's replacements. Used by caches and gradient capture;
        activates the point like an await would.
        """
        self.activate(point, None)
        taps = self._taps
        if taps is None:
            taps = self._taps = {}
        taps.setdefault(point.key, []).append(callback)

    def fire(self, point, value, interrupt: bool = True):
        """Deliver ``value`` at an extension point (gradient, source point) to its waiting tasks, then its taps.

        Returns the merged replacement, or ``None`` if no task replaced it.
        ``interrupt=False`` leaves stopping to the next module hook (for
        firings inside a backward pass).
        """
        firing = Firing(point, value, self.layout)
        kernel = self.kernel
        kernel.provide(point.key, firing.view_for, firing)
        if interrupt and (kernel.failures or kernel.stop_requested or self.cancelled):
            self._interrupt()
        new = firing.result()
        if self._taps:
            self._tapped(point.key, value if new is None else new)
        return new

    # --------------------------------- run interface: requests from interventions
    def replace(self, trap, task, value, shape_change: bool = False, dtype_change: bool = False) -> None:
        firing = self.firing(trap.key)
        if firing is None:
            raise NotInRunError(
                f"{trap.describe()} is not firing now: replace it right after `await {trap.describe()}` "
                "(before the intervention awaits anything else)")
        firing.replace(task.group, trap, value, shape_change, dtype_change)

    def skip(self, envoy, task, value) -> None:
        """``envoy.skip(value)``: the module's next call outputs ``value`` for this invoke.

        Before the module starts, its ``forward`` is swapped for one that
        returns ``value`` (nothing is computed) when the invoke owns the whole
        batch; otherwise, or when called at the module's own input point
        (torch has chosen the forward by then), the module runs and this
        invoke's rows of its output are replaced. Skipping a module that
        already ran in this pass is an ``OutOfOrderError``.
        """
        module = envoy.module
        if envoy.root is not self.model:
            raise NotInRunError(f"{envoy.path} belongs to another wrapped model")
        output = envoy.output
        kernel = self.kernel
        at_input = self.in_firing(envoy.inputs.key)
        now = kernel.current_point
        if not at_input and kernel.has_run(output, task) or at_input and kernel.fired.get(output.key, 0) > \
                task.consumed.get(output.key, 0):
            where = await_site(task.coro) if task.coro is not None else "<unknown line>"
            raise OutOfOrderError(
                f"{envoy.path}.skip(...) at {where}: {envoy.path} already ran in this forward pass (the "
                f"intervention is at {now.describe() if now is not None else 'the start of the pass'}), so "
                "there is nothing left to skip. Call skip before the module runs, e.g. right after awaiting "
                "a point of an earlier module, or at the start of the intervention")
        where = await_site(task.coro)
        if not at_input and self.layout.covers_all(task.group) and not (self._skips and module in self._skips):
            restore = _ForwardRestore(module, instance_forward(module), f"{envoy.path}.skip(...) at {where}")

            def skipped_forward(*args, **kwargs):
                restore.remove()
                restore.applied = True
                return value
            set_instance_forward(module, skipped_forward)
            self._handles.append(restore)
            if self._pending_skips is None:
                self._pending_skips = []
            self._pending_skips.append(restore)
        else:
            if self._skips is None:
                self._skips = {}
            self._skips.setdefault(module, []).append((task.group, value, f"{envoy.path}.skip(...) at {where}"))
            self.activate(output, task)

    def call_attached(self, envoy, args, kwargs):
        """Call a module attached to the model (``model.attach``): a real call whose points fire.

        Its points are per invoke: they deliver this call's values to the
        calling invoke's tasks only (each invoke has its own copy of the
        attached envoy, see ``Envoy.for_invoke``).
        """
        task = current_task()
        group = envoy.invoke if envoy.invoke is not None else (task.group if task is not None else None)
        prev, self._attached_caller = self._attached_caller, group
        try:
            return envoy.module(*args, **kwargs)
        finally:
            self._attached_caller = prev

    def call_adhoc(self, module, args, kwargs):
        return call_quietly(module, args, kwargs)

    def parked_holding(self, task) -> None:
        """Kernel host: ``task`` waits on a future or sub-task holding the value of ``task.position``."""
        v = task.last_value
        if type(v) is torch.Tensor and not v.is_inference() and task.position is not None:
            task.watch_next(StaleWatch(self, v, task.position))

    def left_step_loop(self, task) -> None:
        """Kernel host: ``task`` finished while inside ``m.steps()`` (it left with ``break``/``return``).

        In a run with steps, that ends the generation (as ``m.stop()`` would)
        once no other intervention of the run (of the task's invoke, under
        ``stop_per_invoke``) is still live: nobody is left to observe or change
        later steps. Invokes marked ``background`` (persistent edits) do not count.
        """
        if not self.stepping:
            return
        scope = task.group if self.stop_per_invoke else None
        invokes = self.invokes
        for t in self.kernel.tasks:
            if t.done or t is task or (scope is not None and t.group != scope):
                continue
            if t.group < len(invokes) and invokes[t.group].background:
                continue
            return
        self.stop(scope)

    def request_stop(self, task) -> None:
        """``m.stop()`` from ``task``: the whole run, or only its invoke when ``stop_per_invoke``."""
        if task is None:
            raise NotInRunError("m.stop() can only be called inside an intervention")
        self.stop(task.group if self.stop_per_invoke else None)

    def stop(self, invoke=None) -> None:
        """Stop the model after the current hook firing; finished tasks keep their results.

        ``invoke``: stop only that invoke (its unfinished tasks close at the
        next hook point, as a stopped run would leave them; the forward goes on
        for the others). It is recorded in ``stopped_invokes``.
        """
        if invoke is None:
            self.kernel.request_stop()
        else:
            if type(self.stopped_invokes) is not set:
                self.stopped_invokes = set()
            self.stopped_invokes.add(invoke)
            self.kernel.cancel_group(invoke)

    def cancel(self) -> None:
        """Thread-safe: stop the model at its next hook point and raise ``RunCancelled``."""
        self.cancelled = True

    # -------------------------------------------- run interface: steps
    def track_steps(self, module, on_step=None) -> None:
        """Treat every call of ``module`` after the first as the start of a new step.

        Used by generation: each call of the top-level model is one step.
        ``on_step(step, args, kwargs)`` runs first (e.g. to update the layout).
        """
        calls = [0]
        self.stepping = True

        def pre(mod, args, kwargs):
            ident = get_ident()
            if ident != self._thread or ident in QUIET_THREADS:
                return None
            if self.cancelled:
                raise StopForward()
            if calls[0]:
                if on_step is not None:
                    on_step(self.kernel.step + 1, args, kwargs)
                self.begin_step()
            calls[0] += 1
            return None
        self._hook_set().pre(module, pre, True)
        self._kept.add(module)

    def begin_step(self, active=None) -> None:
        """A new step (forward pass) begins; ``active``: the invokes taking part (``None``: all).

        Raises :class:`StopForward` when the run must stop now.
        """
        kernel = self.kernel
        kernel.begin_step(active)
        if kernel.interrupted:
            raise StopForward()

    def end_invoke(self, index) -> None:
        """Invoke ``index`` leaves the run early (its request finished); the others go on."""
        self.kernel.end_group(index)

    # ------------------------------------------------------------ executing
    def start(self) -> None:
        """Make the kernel, start every invoke's interventions and run them to their first await.

        Raises :class:`StopForward` if the run must stop before the forward
        begins. ``execute`` calls it; hosts that drive the model themselves
        (vLLM's worker) call it, then ``begin_step``/``end_invoke``, then
        ``finish`` and ``cleanup``.
        """
        self._thread = get_ident()
        kernel = self.kernel = Kernel(self, self.on_error)
        model = self.model
        for inv in self.invokes:
            inv.bind(self)
            for fn in inv.spec.fns:
                coro = fn(model)
                if type(coro) is not CoroutineType and not inspect.iscoroutine(coro):
                    raise TypeError(
                        f"{callable_name(fn)} returned {type(coro).__name__}, not a coroutine: interventions "
                        "must be `async def` functions taking the model envoy")
                inv.tasks.append(kernel.spawn(coro, inv.index, fn))   # the task is named after fn (when asked)
            if inv.cancelled:
                kernel.cancel_group(inv.index)
        if kernel.cancel_requests:
            kernel.apply_cancels()
        kernel.drain()
        if kernel.failures or kernel.stop_requested:
            if kernel.interrupted:
                raise StopForward()

    def execute(self, forward) -> None:
        """Start the tasks, call ``forward()`` and finish the kernel. Always cleans up."""
        model = self.model
        lock = model.run_lock
        if not lock.acquire(model.lock_timeout):
            raise RuntimeError(
                f"the model is busy with another run for more than {model.lock_timeout} s; runs on one model "
                "execute one at a time (use a serve.Batcher to share forwards between concurrent requests)")
        recorder = None
        try:
            self.start()
            if model.needs_order_recording():
                recorder = model.start_order_recording()
            try:
                self.output = forward()
            except StopForward:
                self.stopped = True
            if recorder is not None:
                model.finish_order_recording(recorder)
                recorder = None
            if self.cancelled:
                raise RunCancelled("the run was cancelled; the forward stopped at a hook point and every hook was removed")
            kernel = self.kernel
            if not self.stopped:
                if self._skips or self._pending_skips:
                    self._check_skips()
                kernel.finish()
            elif kernel.stop_requested and not kernel.failures:
                kernel.end_step_loops()   # m.stop(): step loops end cleanly, the code after them runs
        except StopForward:
            self.stopped = True
        finally:
            if recorder is not None:
                recorder.stop()
            self.cleanup()
            lock.release()
        self.finished()

    def _check_skips(self) -> None:
        missed = [what for entries in self._skips.values() for _, _, what in entries] if self._skips else []
        if self._pending_skips:
            missed += [r.what for r in self._pending_skips if not r.applied]
            self._pending_skips.clear()
        for what in missed:
            self.kernel.record_failure(MissedHookPoint(
                f"{what} was never applied: the module did not run again after it in this run. Call skip "
                "before the module runs (a module that already ran in this pass cannot be skipped)"))

    def finished(self) -> None:
        """Mark the run and its invokes done; raise the interventions' failures (``on_error="stop"``)."""
        self.done = True
        kernel = self.kernel
        ref = weakref.ref(self)
        for inv in self.invokes:
            inv.finish(ref)
            for task in inv.tasks:
                result = task.result
                if result is not None and type(result) not in PLAIN_RESULTS:   # (the common case skips the call)
                    err = forgotten_await(task)
                    if err is not None and kernel is not None:
                        kernel.fail(task, err)
        failures = kernel.failures if kernel is not None else ()
        if failures and self.on_error == "stop":
            self._raise(failures)
        # on_error="continue": each failure stays with its own invoke (invoke.result raises it)

    def cleanup(self) -> None:
        """Close the kernel, remove every hook and drop every reference the run took (idempotent)."""
        kernel = self.kernel
        if kernel is not None:
            kernel.close()
        handles = self._handles
        if handles:
            for h in reversed(handles):
                h.remove()
            handles.clear()
            self._hooks = None
            self._installed = self._kept = _NO_POINTS
        self._taps = self._skips = self._pending_skips = self._state = None

    def _raise(self, failures):
        if len(failures) == 1:
            raise failures[0]
        failures = list(failures)
        group = ExceptionGroup if all(isinstance(f, Exception) for f in failures) else BaseExceptionGroup
        raise group(f"{len(failures)} interventions failed", failures)


_NO_POINTS = frozenset()       # Run._installed / _kept until the run hooks something


class _ForwardRestore:
    """A handle that restores a module's ``forward`` attribute (for skip)."""

    def __init__(self, module, original, what):
        self.module = module
        self.original = original
        self.what = what
        self.applied = False

    def remove(self):
        set_instance_forward(self.module, self.original)
