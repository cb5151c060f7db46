"""How much of the every-block read's cost is the design, and how much is asyncinterp's own code?

Issue 11 asks for reading every block of a 12 x 64 GPT-2 (sequence 32) at no
more than 1.05x hand-written hooks. This script times, in paired rounds in one
process, asyncinterp's read against prototypes of the same coroutine-driven
read, each a few lines, so that the gap can be split into parts:

* ``hooks``: hand-written ``register_forward_hook`` on every block (the floor of overhead.py);
* ``floor``: an ``async def`` awaiting one tiny trap per block; each hook sends the output into the
  coroutine and writes the hook of the next trap straight into the module's hook dict. No bookkeeping;
* ``inlined``: ``floor`` plus the bookkeeping asyncinterp keeps per read (call counts per point,
  waiter lists, the firing's entry, the task's consumed counts and position, the current point, the
  out-of-order check against a recorded place, the installed set, the running task in a ContextVar),
  written in three functions;
* ``split``: the same bookkeeping split into the functions asyncinterp calls (hook, provide, resume,
  trap handler, already_ran, ran_before, activate, activate_in, install_point, output_hook, HookSet.forward);
* ``station``: the same bookkeeping kept in one object per point and run (its call count, its waiter,
  its entry) instead of the run's dicts keyed by point: the "one object per firing" layout;
* ``kernel``: asyncinterp's real ``Kernel`` (``provide``, its resume loop and trap table), with a
  minimal host in place of ``Run`` (it installs an output hook with ``HookSet`` and answers
  ``already_ran`` from the trap's place);
* ``envoys``: ``inlined``, but awaiting the real ``ai.wrap`` envoys' ``b.output`` points
  (``for b in m.transformer.h``);
* ``asyncinterp``: ``model.trace(x, read_all)``, and ``empty``: ``model.trace(x, empty)`` against ``plain``.

Every prototype is checked to read exactly what the hand-written hooks read.

Usage::

    python benchmarks/designfloor.py --rounds 800

Thread-CPU clock, medians with 95% CIs (order statistics) of the per-round
paired differences against ``hooks``. See benchmarks/README.md, "designfloor.py".
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import sys
from contextvars import ContextVar

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from asyncinterp.hooks.modules import HookSet  # noqa: E402
from asyncinterp.kernel import scheduler  # noqa: E402
from asyncinterp.kernel.scheduler import Kernel, running_task  # noqa: E402
from asyncinterp.kernel.traps import PointTrap  # noqa: E402

_hook_ids = itertools.count(-10**9, -1)   # negative keys, as asyncinterp's HookSet: never torch's ids
_running = ContextVar("designfloor_task", default=None)


class Trap:
    """A prototype's awaitable point: a module and its place in the module call order."""

    __slots__ = ("module", "key", "read", "place")

    def __init__(self, module, place):
        self.module = module
        self.key = self
        self.read = None
        self.place = place

    def __await__(self):
        if _running.get() is None:
            raise RuntimeError("awaited outside a prototype run")
        return (yield self)


class BareTrap(Trap):
    """``floor``'s trap: no check that a run is stepping it."""

    __slots__ = ()

    def __await__(self):
        return (yield self)


class KernelTrap(PointTrap):
    """``kernel``'s trap: a ``PointTrap`` (what the real kernel accepts) that checks asyncinterp's running task."""

    __slots__ = ("module", "key", "place")

    def __init__(self, module, place):
        self.module = module
        self.key = self
        self.place = place

    def __await__(self):
        if running_task() is None:
            raise RuntimeError("awaited outside a run")
        return (yield self)


class Task:
    __slots__ = ("coro", "consumed", "position", "waiting", "last_value", "done")

    def __init__(self, coro):
        self.coro = coro
        self.consumed = {}
        self.position = None
        self.waiting = None
        self.last_value = None
        self.done = False


def floor_read(module, x, traps):
    """``floor``: send each output into the coroutine, hook the trap it yields next."""
    async def read_all():
        return [await t for t in traps]

    coro = read_all()
    written = []
    result = []

    def install(trap):
        key = next(_hook_ids)
        hooks = trap.module._forward_hooks
        hooks[key] = hook
        written.append((hooks, key))

    def hook(mod, args, output):
        try:
            trap = coro.send(output)
        except StopIteration as stop:
            result.append(stop.value)
            return None
        install(trap)
        return None

    install(coro.send(None))
    try:
        module(x)
    finally:
        for hooks, key in reversed(written):
            hooks.pop(key, None)
    return result[0]


class Inlined:
    """``inlined``: the per-read bookkeeping of asyncinterp's kernel and run, in three functions."""

    running = _running   # the ContextVar its traps check

    def __init__(self, coro):
        self.fired = {}
        self.waiters = {}
        self.entries = {}
        self.installed = set()
        self.written = []
        self.current = None
        self.failures = []
        self.stop_requested = False
        self.adhoc = 0
        self.result = None
        self.resume(Task(coro), None)

    def place(self, trap):
        return trap.place

    def module_of(self, trap):
        return trap.module

    def resume(self, task, value):
        token = self.running.set(task)
        try:
            try:
                trap = task.coro.send(value)
            except StopIteration as stop:
                task.done = True
                self.result = stop.value
                return
            key = trap.key
            call = task.consumed.get(key, 0)
            fired = self.fired.get(key, 0)
            now = self.current
            if fired > call or (fired == 0 and now is not None and self.place(trap) < self.place(now)):
                raise RuntimeError("out of order")
            if key not in self.installed:
                hooks = self.module_of(trap)._forward_hooks
                hook_id = next(_hook_ids)
                hooks[hook_id] = self.make_hook(key)
                self.written.append((hooks, hook_id))
                self.installed.add(key)
            task.waiting = trap
            waiting = self.waiters.get(key)
            if waiting is None:
                self.waiters[key] = [(task, call, trap)]
            else:
                waiting.append((task, call, trap))
        finally:
            self.running.reset(token)

    def make_hook(self, point):
        def hook(module, args, output):
            if self.adhoc:
                return None
            fired = self.fired
            n = fired.get(point, 0)
            fired[point] = n + 1
            waiting = self.waiters.get(point)
            if waiting is not None and len(waiting) == 1 and waiting[0][1] == n:
                task, _, trap = waiting[0]
                del self.waiters[point]
                entries = self.entries
                entries[point] = output
                previous = self.current
                self.current = trap
                try:
                    if not task.done and task.waiting is trap:
                        task.waiting = None
                        task.consumed[point] = n + 1
                        task.position = trap
                        read = trap.read
                        value = output if read is None else read(output)
                        task.last_value = value
                        self.resume(task, value)
                finally:
                    self.current = previous
                    entries.pop(point)
            if self.failures or self.stop_requested:
                raise RuntimeError("stopped")
            return None
        return hook

    def remove(self):
        for hooks, key in reversed(self.written):
            hooks.pop(key, None)


class Split(Inlined):
    """``split``: ``Inlined``'s bookkeeping in asyncinterp's functions (one call per step)."""

    def resume(self, task, value):
        token = _running.set(task)
        try:
            while True:
                try:
                    trap = task.coro.send(value)
                except StopIteration as stop:
                    task.done = True
                    self.result = stop.value
                    return
                if self.handlers[type(trap)](self, task, trap) is None:
                    return
        finally:
            _running.reset(token)

    def trap_point(self, task, trap):
        key = trap.key
        call = task.consumed.get(key, 0)
        fired = self.fired.get(key, 0)
        now = self.current
        if fired > call or (fired == 0 and now is not None and self.already_ran(trap, now)):
            raise RuntimeError("out of order")
        self.activate(trap, task)
        task.waiting = trap
        waiting = self.waiters.get(key)
        if waiting is None:
            self.waiters[key] = [(task, call, trap)]
        else:
            waiting.append((task, call, trap))
        return None

    handlers = {Trap: trap_point}

    def already_ran(self, trap, now):
        return self.ran_before(trap, now)

    def ran_before(self, trap, now):
        return trap.place < now.place

    def activate(self, trap, task):
        if trap.key not in self.installed:
            self.activate_in(trap)

    def activate_in(self, trap):
        self.install_point(trap.key)

    def install_point(self, point):
        self.forward(point.module, self.output_hook(point))
        self.installed.add(point)

    def forward(self, module, fn):
        key = next(_hook_ids)
        hooks = module._forward_hooks
        hooks[key] = fn
        self.written.append((hooks, key))

    def output_hook(self, point):
        def hook(module, args, output):
            if self.adhoc:
                return None
            self.provide(point, output)
            if self.failures or self.stop_requested:
                raise RuntimeError("stopped")
            return None
        return hook

    def provide(self, point, output):
        fired = self.fired
        n = fired.get(point, 0)
        fired[point] = n + 1
        waiting = self.waiters.get(point)
        if waiting is None or len(waiting) != 1 or waiting[0][1] != n:
            return
        task, _, trap = waiting[0]
        del self.waiters[point]
        entries = self.entries
        entries[point] = output
        previous = self.current
        self.current = trap
        try:
            if not task.done and task.waiting is trap:
                task.waiting = None
                task.consumed[point] = n + 1
                task.position = trap
                read = trap.read
                value = output if read is None else read(output)
                task.last_value = value
                self.resume(task, value)
        finally:
            self.current = previous
            entries.pop(point)


class Station:
    """``station``'s record of one point in one run: everything a read touches, in one object."""

    __slots__ = ("point", "count", "waiter", "entry")

    def __init__(self, point):
        self.point = point
        self.count = 0
        self.waiter = None
        self.entry = None


class OnStations(Inlined):
    """``station``: ``Inlined``'s bookkeeping kept per point in a :class:`Station` instead of dicts keyed by point."""

    def __init__(self, coro):
        self.stations = {}
        Inlined.__init__(self, coro)

    def resume(self, task, value):
        token = self.running.set(task)
        try:
            try:
                trap = task.coro.send(value)
            except StopIteration as stop:
                task.done = True
                self.result = stop.value
                return
            station = self.stations.get(trap)
            if station is None:
                station = self.stations[trap] = Station(trap)
                hooks = trap.module._forward_hooks
                hook_id = next(_hook_ids)
                hooks[hook_id] = self.make_hook(station)
                self.written.append((hooks, hook_id))
            now = self.current
            call = task.consumed.get(trap, 0)
            if station.count > call or (station.count == 0 and now is not None and trap.place < now.place):
                raise RuntimeError("out of order")
            task.waiting = trap
            station.waiter = (task, call)
        finally:
            self.running.reset(token)

    def make_hook(self, station):
        def hook(module, args, output):
            if self.adhoc:
                return None
            n = station.count
            station.count = n + 1
            waiter = station.waiter
            if waiter is not None and waiter[1] == n:
                task = waiter[0]
                trap = station.point
                station.waiter = None
                station.entry = output
                previous = self.current
                self.current = trap
                try:
                    if not task.done and task.waiting is trap:
                        task.waiting = None
                        task.consumed[trap] = n + 1
                        task.position = trap
                        read = trap.read
                        value = output if read is None else read(output)
                        task.last_value = value
                        self.resume(task, value)
                finally:
                    self.current = previous
                    station.entry = None
            if self.failures or self.stop_requested:
                raise RuntimeError("stopped")
            return None
        return hook


class OnEnvoys(Inlined):
    """``envoys``: ``Inlined`` stepping a coroutine that awaits ``ai.wrap`` envoys' hook points."""

    places = {}   # HookPoint -> place in the call order (filled by cases())

    def place(self, trap):
        return self.places[trap]

    def module_of(self, trap):
        return trap.envoy.module


def kernel_read(module, x, coro):
    """``kernel``: the real ``Kernel`` driven by :class:`MinimalHost`."""
    host = MinimalHost()
    kernel = host.kernel = Kernel(host)
    task = kernel.spawn(coro, 0)
    kernel.drain()
    try:
        module(x)
        kernel.finish()
    finally:
        kernel.close()
        host.hooks.remove()
    if task.exc is not None:
        raise task.exc
    return task.result


class MinimalHost:
    """The least a kernel host does for output points: hook the module, answer from the trap's place."""

    def __init__(self):
        self.hooks = HookSet()
        self.installed = set()
        self.kernel = None

    def activate(self, trap, task):
        if trap not in self.installed:
            self.hooks.forward(trap.module, self.output_hook(trap))
            self.installed.add(trap)

    def output_hook(self, point):
        kernel = self.kernel

        def hook(module, args, output):
            kernel.provide(point, None, output)
            if kernel.failures or kernel.stop_requested:
                raise RuntimeError("stopped")
            return None
        return hook

    def already_ran(self, trap, now):
        return trap.place < now.place

    def view_of(self, task, trap):   # never called: this host does not replace entries
        raise AssertionError

    def parked_holding(self, task):   # nothing to watch
        pass

    def left_step_loop(self, task):   # no steps
        pass


def prototype_read(cls, module, x, coro):
    run = cls(coro)
    try:
        module(x)
    finally:
        run.remove()
    return run.result


def cases():
    import asyncinterp as ai
    from hotpath import gpt2_12x64, gpt2_cases

    module, x = gpt2_12x64()
    gc.freeze()
    blocks = list(module.transformer.h)
    traps = [Trap(b, i) for i, b in enumerate(blocks)]
    kernel_traps = [KernelTrap(b, i) for i, b in enumerate(blocks)]
    bare = [BareTrap(b, i) for i, b in enumerate(blocks)]
    ours = gpt2_cases(ai, module, x)
    envoys = ai.wrap(module)
    OnEnvoys.places = {b.output: i for i, b in enumerate(envoys.transformer.h)}
    OnEnvoys.running = scheduler._running   # what HookPoint.__await__ checks

    async def on_traps():
        return [await t for t in traps]

    async def on_kernel_traps():
        return [await t for t in kernel_traps]

    async def on_envoys(m):
        return [await b.output for b in m.transformer.h]

    return {
        "plain": ours["gpt2-plain"],
        "hooks": ours["gpt2-hooks-all"],
        "floor": lambda: floor_read(module, x, bare),
        "inlined": lambda: prototype_read(Inlined, module, x, on_traps()),
        "split": lambda: prototype_read(Split, module, x, on_traps()),
        "station": lambda: prototype_read(OnStations, module, x, on_traps()),
        "kernel": lambda: kernel_read(module, x, on_kernel_traps()),
        "envoys": lambda: prototype_read(OnEnvoys, module, x, on_envoys(envoys)),
        "asyncinterp": ours["gpt2-read-all"],
        "empty": ours["gpt2-empty"],
    }


def _first(v):
    return v[0] if isinstance(v, tuple) else v


def check(fns) -> None:
    """Every read-all case reads exactly what the hand-written hooks read."""
    import torch
    want = [_first(v) for v in fns["hooks"]()]
    for name in ("floor", "inlined", "split", "station", "kernel", "envoys", "asyncinterp"):
        got = [_first(v) for v in fns[name]()]
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want)), name


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=800)
    args = p.parse_args()
    import torch

    from hotpath import paired_samples
    from overhead import _median_ci
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    fns = cases()
    check(fns)
    samples = paired_samples(fns, args.rounds)

    def ci(values, fmt):
        m, lo, hi = _median_ci(values)
        return f"{m:{fmt}} ({lo:{fmt}}…{hi:{fmt}})"

    print(f"{args.rounds} paired rounds, thread-CPU clock, medians with 95% CIs")
    print("| case | µs per call | minus hooks, µs (paired) | / hooks (paired) |")
    print("|---|---:|---:|---:|")
    hooks = samples["hooks"]
    for name, s in samples.items():
        diff = [a - b for a, b in zip(s, hooks)]
        ratio = [a / b for a, b in zip(s, hooks)]
        print(f"| {name} | {_median_ci(s)[0]:,.1f} | {ci(diff, '+.1f')} | {ci(ratio, '.3f')} |")
    fixed = [a - b for a, b in zip(samples["empty"], samples["plain"])]
    print(f"\nempty run over plain forward: {ci(fixed, '+.1f')} µs")


if __name__ == "__main__":
    main()
