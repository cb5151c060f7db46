"""The probe of scripts/walks.py: the call stacks of one process at the first hook firing of a walk.

Loaded in every Python process of a walk (``scripts/walk_probe/sitecustomize.py`` puts it there when
``ASYNCINTERP_WALK_DIR`` is set; the walk's own process calls :func:`install`). It does nothing else:

* a thread of its own (restarted in every forked child) watches the walk's folder; when a trigger
  appears (the file ``trigger-baseline``, or anything written to ``fire-signal``) it appends the stacks
  of every other thread and of every pending asyncio task of this process to ``out-PID.jsonl``. The
  baseline is taken once the process has settled (two snapshots a moment apart with the same stacks): on
  a loaded machine a worker may still be finishing the warm-up request when the trigger appears, and a
  baseline taken then would hide the measured request's stacks;
* once ``asyncinterp.kernel.scheduler`` is imported it wraps ``Kernel.provide`` (what a hook calls):
  while the folder holds ``armed``, the first call in the whole walk appends its own thread's stack,
  writes a byte to ``fire-signal`` and holds the hook until the walk writes ``released`` (once every
  process that took a baseline has written its stacks), so that every process writes them while the
  request is still where it was when the hook fired, however slow the machine.

Both files are opened when the process (or forked child) starts, before a worker confines itself:
a confined worker may not open a file for writing, but writes to descriptors it holds. A frame is
``[file, line, qualified name]``; stacks run from the outermost frame to the innermost.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

POLL_S = 0.02          # how often the watcher looks at the walk's folder
SETTLE_EVERY_S = 0.25  # a baseline is taken when two snapshots this far apart have the same stacks...
SETTLE_MAX_S = 30.0    # ...or, if the process never settles, the last snapshot after this long
FIRE_HOLD_MAX_S = 120.0  # the firing thread waits for the walk's ``released`` file at most this long


def frames_of(frame) -> list:
    out = []
    while frame is not None:
        out.append([frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_qualname])
        frame = frame.f_back
    return out[::-1]


def _frame_of(obj):
    return getattr(obj, "cr_frame", None) or getattr(obj, "gi_frame", None) or getattr(obj, "ag_frame", None)


def _await_chain(coro) -> list:
    """The frames of a suspended coroutine and of everything it awaits (``Task.get_stack`` gives only the first).

    ``async for`` awaits an ``async_generator_asend`` object, which shows its generator only to the collector.
    """
    import gc
    frames = []
    for _ in range(200):
        if coro is None:
            break
        frame = _frame_of(coro)
        if frame is None:
            inner = [o for o in gc.get_referents(coro) if _frame_of(o) is not None]
            if not inner:
                break
            coro = inner[0]
            continue
        frames.append([frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_qualname])
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) or getattr(coro, "ag_await", None)
    return frames


def _task_stacks() -> list:
    import asyncio.tasks as tasks
    for _ in range(10):
        try:   # the weak sets of tasks may change while we copy them (another thread's loop)
            pending = set(getattr(tasks, "_all_tasks", ())) | set(getattr(tasks, "_scheduled_tasks", ()))
            break
        except RuntimeError:
            time.sleep(0.001)
    else:
        pending = set()
    out = []
    for task in list(pending):
        try:
            if task.done():
                continue
            out.append({"name": task.get_name(), "frames": _await_chain(task.get_coro())})
        except Exception:   # a task of another thread's loop may change under us: skip it
            continue
    return out


def _shape(snapshot: dict) -> tuple:
    stacks = [tuple((f[0], f[2]) for f in s["frames"]) for s in snapshot["threads"] + snapshot["tasks"]]
    return tuple(sorted(stacks))


class Probe:
    def __init__(self, folder: str):
        self.folder = folder
        self.done: set = set()
        self.patched = False
        self.watcher = None

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def write(self, data: dict) -> None:
        os.write(self.out, (json.dumps(data) + "\n").encode())

    def fired(self) -> bool:
        try:
            return os.path.getsize(self.path("fire-signal")) > 0
        except OSError:   # the walk is over and its folder gone
            return False

    def snapshot(self, kind: str) -> dict:
        me = threading.get_ident()
        names = {t.ident: t.name for t in threading.enumerate()}
        threads = [{"name": names.get(ident, str(ident)), "ident": ident, "frames": frames_of(frame)}
                   for ident, frame in sys._current_frames().items() if ident != me]
        return {"pid": os.getpid(), "argv": sys.argv[:6], "kind": kind, "threads": threads, "tasks": _task_stacks()}

    def dump(self, kind: str) -> None:
        self.write(self.snapshot(kind))

    def dump_settled(self, kind: str) -> None:
        """Write a snapshot once two taken ``SETTLE_EVERY_S`` apart have the same stacks (lines aside)."""
        deadline = time.monotonic() + SETTLE_MAX_S
        last = now = self.snapshot(kind)
        while time.monotonic() < deadline:
            time.sleep(SETTLE_EVERY_S)
            now = self.snapshot(kind)
            if _shape(now) == _shape(last):
                break
            last = now
        else:
            now["unsettled"] = True
        self.write(now)

    def fire(self, frame) -> None:
        if self.fired():
            return    # another process (or thread) fired first
        self.write({"pid": os.getpid(), "argv": sys.argv[:6], "kind": "firing", "ident": threading.get_ident(),
                    "frames": frames_of(frame)})
        os.write(self.signal, b"!")
        released, deadline = self.path("released"), time.monotonic() + FIRE_HOLD_MAX_S
        while not os.path.exists(released) and time.monotonic() < deadline:
            time.sleep(POLL_S)

    def patch(self) -> None:
        scheduler = sys.modules.get("asyncinterp.kernel.scheduler")
        if self.patched or scheduler is None or not hasattr(scheduler, "Kernel"):
            return
        self.patched = True
        original = scheduler.Kernel.provide
        if getattr(original, "walk_probe", False):
            return
        armed = self.path("armed")
        probe = self

        def provide(kernel, *args, **kwargs):
            if os.path.exists(armed) and not probe.fired():
                probe.fire(sys._getframe(1))
            return original(kernel, *args, **kwargs)

        provide.walk_probe = True
        scheduler.Kernel.provide = provide

    def watch(self) -> None:
        while os.path.isdir(self.folder):   # the walk removes its folder when it ends
            self.patch()
            for kind, now in (("baseline", os.path.exists(self.path("trigger-baseline"))), ("fire", self.fired())):
                if kind not in self.done and now:
                    self.done.add(kind)
                    try:
                        self.dump_settled(kind) if kind == "baseline" else self.dump(kind)
                    except Exception as e:   # a probe must never break the process it watches
                        print(f"walk probe: {kind} dump failed in {os.getpid()}: {e!r}", file=sys.stderr)
            time.sleep(POLL_S)

    def start(self) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
        self.out = os.open(self.path(f"out-{os.getpid()}.jsonl"), flags)
        self.signal = os.open(self.path("fire-signal"), flags)
        self.done = set()
        self.watcher = threading.Thread(target=self.watch, name="walk-probe", daemon=True)
        self.watcher.start()


_PROBE = None


def install(folder: str) -> Probe:
    """Start the probe in this process (and in every child it forks)."""
    global _PROBE
    if _PROBE is None:
        _PROBE = Probe(folder)
        _PROBE.start()
        os.register_at_fork(after_in_child=_PROBE.start)
    return _PROBE
