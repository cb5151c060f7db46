"""One run: the kernel's host while a model executes.

A run owns a kernel, the hooks it installs, the layout of the batch and the
firings in progress. It turns each torch hook call into ``kernel.provide``,
applies the tasks' replacements, stops the model when asked (stop, failure,
cancellation) and, whatever happens, removes every hook and drops every
reference it took before it returns.
"""

from __future__ import annotations

import inspect
import itertools
import weakref

import torch

from .kernel.errors import (
    AsyncInterpError,
    NotInRunError,
    ReplacementError,
    RunCancelled,
)
from .hooks.envoy import HookPoint
from .kernel.scheduler import Kernel
from .hooks.order import OrderRecorder
from .hooks.views import Layout, check_replacement


class _Interrupt(BaseException):
    """Unwinds the model's forward when the run must stop now (not an Exception, so model code cannot catch it)."""


class RunStopped(AsyncInterpError):
    """Reading the result of an invoke whose task did not finish because the run was stopped early."""


class Invoke:
    """One input of a run and the interventions that see its rows."""

    def __init__(self, run, index, input, fns, kwargs=None):
        self.run = run
        self.index = index
        self.input = input
        self.fns = list(fns)
        self.kwargs = kwargs or {}
        self.tasks = []
        self.cancelled = False

    def cancel(self) -> None:
        """Thread-safe: close this invoke's interventions at the model's next hook point.

        The other invokes of the run, and the forward itself, go on; this
        invoke's ``result`` then raises ``RunCancelled``. (``Run.cancel`` stops
        the whole run instead.)
        """
        if self.run.done:   # too late: it finished; keep its result
            return
        self.cancelled = True
        kernel = self.run.kernel
        if kernel is not None:
            kernel.cancel_group(self.index)

    @property
    def result(self):
        """The intervention's return value (a tuple if the invoke has several)."""
        if not self.run.done:
            raise RuntimeError("the run has not been executed yet; leave the `with model.trace()` block or call run.run()")
        if self.cancelled:
            raise RunCancelled(f"invoke {self.index} was cancelled (Invoke.cancel); the other invokes of its run went on")
        values = []
        for t in self.tasks:
            if not t.done or t.closed:
                raise RunStopped(f"intervention {t.name!r} of invoke {self.index} did not finish: the run stopped early")
            if t.exc is not None:
                raise t.exc
            values.append(t.result)
        if len(values) == 1:
            return values[0]
        return tuple(values)


class _Firing:
    """One hook point firing: the full value, per-invoke views, replacements."""

    __slots__ = ("point", "value", "layout", "views", "replaced")

    def __init__(self, point, value, layout):
        self.point = point
        self.value = value
        self.layout = layout
        self.views = {}
        self.replaced = None

    def base_view(self, group):
        views = self.views
        if group in views:
            return views[group]
        if self.replaced and group in self.replaced:
            return self.replaced[group]
        v = self.layout.view(self.value, group)
        views[group] = v
        return v

    def view_for(self, task, trap):
        v = self.base_view(task.group)
        if trap.read is not None:
            v = trap.read(v)
        return v

    def replace(self, group, trap, new):
        old = self.base_view(group)
        if trap.write is not None:
            new = trap.write(new, old)
        check_replacement(trap.key.describe(), new, old)
        if self.replaced is None:
            self.replaced = {}
        self.replaced[group] = new
        self.views.pop(group, None)

    def result(self):
        if not self.replaced:
            return None
        return self.layout.merge(self.value, self.replaced)


class Run:
    """Executes a forward pass (or a generation) with interventions attached."""

    def __init__(self, model, layout: Layout | None = None, on_error: str = "stop"):
        if on_error not in ("stop", "continue"):
            raise ValueError(f"on_error must be 'stop' (a failing intervention stops the run) or 'continue' "
                             f"(it fails only its own invoke), got {on_error!r}")
        self.model = model                 # the root envoy (a Model)
        self.layout = layout or Layout()
        self.on_error = on_error
        self.invokes = []
        self.kernel = None
        self.done = False
        self.output = None
        self.stopped = False
        self.cancelled = False
        self.cancellable = False           # set by the aio layer: add cancellation checkpoints
        self._handles = []
        self._installed = set()
        self._kept = set()
        self._active = {}
        self._skips = {}
        self._adhoc = 0
        self._recording = None
        self._taps = {}                    # point key -> callbacks seeing each firing's final value

    # ------------------------------------------------------------- building
    def invoke(self, input=None, *fns, **kwargs) -> Invoke:
        """Add an input (``None``: the invoke sees the whole batch) and its interventions."""
        if callable(input) and not fns and not isinstance(input, torch.Tensor) and _is_async_fn(input):
            input, fns = None, (input,)
        for fn in fns:
            _check_intervention(fn)
        inv = Invoke(self, len(self.invokes), input, fns, kwargs)
        self.invokes.append(inv)
        return inv

    # --------------------------------------------------------- kernel host
    def activate(self, trap, task) -> None:
        if not isinstance(trap, HookPoint):  # extension points (gradients, source points) install themselves
            return trap.activate_in(self, task)
        envoy = trap.envoy
        if envoy._root is not self.model:
            raise NotInRunError(
                f"{trap.describe()} belongs to another wrapped model; inside this run await the hook points of "
                "the envoy your intervention received")
        base = trap.key
        if base in self._installed:
            return
        module = envoy._module
        if base.base_kind == "output":
            h = _add_hook(module._forward_hooks, self._output_hook(base))
        else:
            h = _add_hook(module._forward_pre_hooks, self._input_hook(base), module._forward_pre_hooks_with_kwargs)
        self._handles.append(h)
        self._installed.add(base)
        self._keep_ancestors(envoy)

    def _keep_ancestors(self, envoy):
        # A hook added while a module is already running only fires if that
        # module took torch's hooked path, i.e. had some hook when it started.
        e = envoy._parent
        while e is not None and e._module not in self._kept:
            self._kept.add(e._module)
            self._handles.append(_add_hook(e._module._forward_pre_hooks, self._keepalive))
            e = e._parent
        if self.cancellable:
            # async runs: siblings along the path check for cancellation too, so
            # a cancel lands at the next layer rather than at the awaited point
            e = envoy
            while e._parent is not None:
                for sibling in e._parent._module._modules.values():
                    if sibling is not None and sibling not in self._kept:
                        self._kept.add(sibling)
                        self._handles.append(_add_hook(sibling._forward_pre_hooks, self._keepalive))
                e = e._parent

    def _keepalive(self, module, args):
        if self.cancelled:
            raise _Interrupt()

    def already_ran(self, trap, current_point) -> bool:
        order = self.model._call_order
        if order is None:
            return False
        if type(trap) is HookPoint and type(current_point) is HookPoint:
            return order.already_ran(trap.envoy._module, trap.base_kind,
                                     current_point.envoy._module, current_point.base_kind)
        target, now = _order_position(trap), _order_position(current_point)
        if target is None or now is None:
            return False
        return order.already_ran(target[0], target[1], now[0], now[1])

    def _deliver(self, key, firing) -> bool:
        """Resume the tasks waiting on ``key`` with ``firing``; True if the model must stop now."""
        active = self._active
        prev = active.get(key)
        active[key] = firing
        try:
            self.kernel.provide(key, firing.view_for)
        finally:
            if prev is None:
                del active[key]
            else:
                active[key] = prev
        kernel = self.kernel
        return bool(kernel.failures or kernel.stop_requested or self.cancelled) and (
            kernel.interrupted or self.cancelled)

    def _tapped(self, point, final) -> None:
        taps = self._taps.get(point)
        if taps is not None:
            for tap in taps:
                tap(final)

    def _output_hook(self, point):
        def hook(module, args, output):
            if self._adhoc:
                return None
            skips = self._skips.pop(module, None)
            firing = _Firing(point, output, self.layout)
            if skips:
                for group, value in skips:
                    firing.replace(group, point, value)
            if self._deliver(point, firing):
                raise _Interrupt()
            result = firing.result() if firing.replaced else None
            if self._taps:
                self._tapped(point, output if result is None else result)
            return result
        return hook

    def _input_hook(self, point):
        def hook(module, args, kwargs):
            if self._adhoc:
                return None
            firing = _Firing(point, (args, kwargs), self.layout)
            if self._deliver(point, firing):
                raise _Interrupt()
            new = firing.result() if firing.replaced else None
            if self._taps:
                self._tapped(point, (args, kwargs) if new is None else new)
            if new is None:
                return None
            new_args, new_kwargs = new
            return tuple(new_args), dict(new_kwargs)
        return hook

    def tap(self, point, callback) -> None:
        """Call ``callback(value)`` after every firing of base point ``point`` in this run.

        ``value`` is the full (batched) value as the model continues with it,
        after the firing's replacements. Used by caches and gradient capture;
        installs the point's hook like an await would.
        """
        self.activate(point, None)
        self._taps.setdefault(point.key, []).append(callback)

    def fire(self, point, value, interrupt: bool = True):
        """Deliver ``value`` at an extension point (gradient, source point) to its waiting tasks.

        Returns the merged replacement, or ``None`` if no task replaced it.
        ``interrupt=False`` leaves stopping to the next module hook (for
        firings inside a backward pass).
        """
        firing = _Firing(point, value, self.layout)
        if self._deliver(point.key, firing) and interrupt:
            raise _Interrupt()
        return firing.result()

    def replace(self, trap, task, value) -> None:
        firing = self._active.get(trap.key)
        if firing is None:
            raise NotInRunError(
                f"{trap.describe()} is not firing now: replace it right after `await {trap.describe()}` "
                "(before the intervention awaits anything else)")
        firing.replace(task.group, trap, value)

    def skip(self, envoy, task, value) -> None:
        module = envoy._module
        if envoy._root is not self.model:
            raise NotInRunError(f"{envoy._path} belongs to another wrapped model")
        if self.layout.covers_all(task.group) and module not in self._skips:
            original = module.__dict__.get("forward")

            def skipped_forward(*args, **kwargs):
                _restore_forward(module, original)
                return value
            module.forward = skipped_forward
            self._handles.append(_ForwardRestore(module, original))
        else:
            self._skips.setdefault(module, []).append((task.group, value))
            point = envoy.output
            if point.key not in self._installed:
                self.activate(point, task)

    def track_steps(self, module, on_step=None) -> None:
        """Treat every call of ``module`` after the first as the start of a new step.

        Used by generation: each call of the top-level model is one step.
        ``on_step(step, args, kwargs)`` runs first (e.g. to update the layout).
        """
        calls = [0]

        def pre(mod, args, kwargs):
            if self._adhoc:
                return None
            if self.cancelled:
                raise _Interrupt()
            if calls[0]:
                if on_step is not None:
                    on_step(self.kernel.step + 1, args, kwargs)
                self.kernel.begin_step()
                if self.kernel.interrupted:
                    raise _Interrupt()
            calls[0] += 1
            return None
        self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        self._kept.add(module)

    def call_adhoc(self, module, args, kwargs):
        self._adhoc += 1
        try:
            return module(*args, **kwargs)
        finally:
            self._adhoc -= 1

    def stop(self) -> None:
        """Stop the model after the current hook firing; finished tasks keep their results."""
        self.kernel.stop_requested = True

    def cancel(self) -> None:
        """Thread-safe: stop the model at its next hook point and raise ``RunCancelled``."""
        self.cancelled = True

    # ------------------------------------------------------------ executing
    def execute(self, forward) -> None:
        """Start the tasks, call ``forward()`` and finish the kernel. Always cleans up."""
        kernel = self.kernel = Kernel(self, self.on_error)
        model = self.model
        lock = model._lock
        if not lock.acquire(timeout=model.lock_timeout):
            raise RuntimeError(
                f"the model is busy with another run for more than {model.lock_timeout} s; runs on one model "
                "execute one at a time (use a serve.Batcher to share forwards between concurrent requests)")
        recorder = None
        try:
            for inv in self.invokes:
                for fn in inv.fns:
                    coro = fn(model)
                    if not inspect.iscoroutine(coro):
                        raise TypeError(
                            f"{_fn_name(fn)} returned {type(coro).__name__}, not a coroutine: interventions "
                            "must be `async def` functions taking the model envoy")
                    inv.tasks.append(kernel.spawn(coro, inv.index, _fn_name(fn)))
                if inv.cancelled:
                    kernel.cancel_group(inv.index)
            if kernel.cancel_requests:
                kernel.apply_cancels()
            kernel.drain()
            if kernel.interrupted:
                raise _Interrupt()
            if model._call_order is None or not model._call_order.complete:
                recorder = model._start_order_recording()
            try:
                self.output = forward()
            except _Interrupt:
                self.stopped = True
            if recorder is not None:
                recorder.stop()
                model._finish_order_recording(recorder)
            if self.cancelled:
                raise RunCancelled("the run was cancelled; the forward stopped at a hook point and every hook was removed")
            if not self.stopped:
                kernel.finish()
        except _Interrupt:
            self.stopped = True
        finally:
            if recorder is not None:
                recorder.stop()
            self._cleanup()
            lock.release()
        self.done = True
        failures = kernel.failures
        if failures and self.on_error == "stop":
            self._raise(failures)
        # on_error="continue": each failure stays with its own invoke (invoke.result raises it)

    def _cleanup(self):
        kernel = self.kernel
        if kernel is not None:
            kernel.close()
        for h in reversed(self._handles):
            h.remove()
        self._handles.clear()
        self._installed.clear()
        self._kept.clear()
        self._active.clear()
        self._taps.clear()
        self._skips.clear()

    def _raise(self, failures):
        if len(failures) == 1:
            raise failures[0]
        raise ExceptionGroup(f"{len(failures)} interventions failed", list(failures))


_hook_ids = itertools.count(-1, -1)  # negative keys: never collide with torch's own handle ids


class _DictHook:
    """A hook written straight into a module's hook dict (torch's handle objects cost ~2 µs each)."""

    __slots__ = ("hooks", "key", "flags")

    def __init__(self, hooks, key, flags):
        self.hooks = hooks
        self.key = key
        self.flags = flags

    def remove(self):
        self.hooks.pop(self.key, None)
        if self.flags is not None:
            self.flags.pop(self.key, None)


def _add_hook(hooks, fn, flags=None) -> _DictHook:
    key = next(_hook_ids)
    hooks[key] = fn
    if flags is not None:
        flags[key] = True
    return _DictHook(hooks, key, flags)


class _ForwardRestore:
    """A handle that restores a module's ``forward`` attribute (for skip)."""

    def __init__(self, module, original):
        self.module = module
        self.original = original

    def remove(self):
        _restore_forward(self.module, self.original)


def _order_position(point):
    """``(module, kind)`` of a point in the recorded call order, or ``None`` if it has no place there."""
    custom = getattr(point, "order_position", None)
    if custom is not None:
        return custom()
    return point.envoy._module, point.base_kind


def _restore_forward(module, original):
    if original is None:
        module.__dict__.pop("forward", None)
    else:
        module.__dict__["forward"] = original


def _is_async_fn(fn) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _fn_name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


_checked = weakref.WeakSet()


def _check_intervention(fn) -> None:
    try:
        if fn in _checked:
            return
    except TypeError:  # unhashable callables are checked every time
        pass
    _check_intervention_once(fn)
    try:
        _checked.add(fn)
    except TypeError:
        pass


def _check_intervention_once(fn) -> None:
    if inspect.iscoroutine(fn):
        raise TypeError(
            f"got a coroutine object {fn!r}; pass the async function itself (e.g. `fn`, not `fn(m)`), "
            "or wrap arguments with functools.partial / a lambda returning a coroutine")
    if not callable(fn):
        raise TypeError(f"an intervention must be an `async def` function taking the model envoy, got {fn!r}")
    if not _is_async_fn(fn) and not _returns_coroutine_hint(fn):
        raise TypeError(
            f"{_fn_name(fn)} is a plain function; interventions must be `async def` functions taking the model "
            "envoy (`async def fn(m): h = await m.layer.output`)")


def _returns_coroutine_hint(fn) -> bool:
    # functools.partial of an async function, or a lambda returning a coroutine: allowed, checked when called
    import functools
    if isinstance(fn, functools.partial):
        return _is_async_fn(fn.func) or _returns_coroutine_hint(fn.func)
    return getattr(fn, "__name__", "") == "<lambda>"

