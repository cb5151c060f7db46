"""Traps: the small request objects an intervention's ``await`` hands to the kernel.

An intervention is a plain coroutine. Whenever it awaits something of ours, the
innermost ``__await__`` yields one trap object; the kernel inspects the trap,
decides when the coroutine may continue and what value it receives. Every
blocking operation in asyncinterp is one of these few traps; everything else
(gather, steps, sessions) is built from them outside the kernel.

This module is pure Python: no torch, no anyio.
"""

from __future__ import annotations


class Trap:
    """Base class of everything the kernel accepts from ``await``."""

    __slots__ = ()


class PointTrap(Trap):
    """Wait until a hook point fires.

    Subclasses (the hook layer's ``HookPoint``) supply ``key``: a hashable
    identity shared by every trap that waits for the same firing, and
    ``describe()``: a human name used in error messages. ``read``: ``None``,
    or a function mapping the firing's entry to what this trap shows (used
    when the host provides the entry itself, see ``Kernel.provide``).
    """

    __slots__ = ()
    key: object
    read = None

    def describe(self) -> str:  # pragma: no cover - overridden
        return repr(self.key)


class FutureTrap(Trap):
    """Wait until a :class:`~asyncinterp.kernel.futures.Future` is done."""

    __slots__ = ("future",)

    def __init__(self, future):
        self.future = future


class StepTrap(Trap):
    """Wait until the next step (generation step, pass) begins.

    The task is resumed with the new step number, or with ``None`` when the
    run ends before another step begins.
    """

    __slots__ = ()


class SpawnTrap(Trap):
    """Start a sub-task on the same invoke; resumes at once with its handle."""

    __slots__ = ("coro", "name")

    def __init__(self, coro, name=None):
        self.coro = coro
        self.name = name


class JoinTrap(Trap):
    """Wait until a sub-task finishes; resumes with its result or raises its error."""

    __slots__ = ("task",)

    def __init__(self, task):
        self.task = task


class CallTrap(Trap):
    """Run a blocking callable on the kernel's thread and resume with its result.

    Used by the aio layer to call back into the event loop from inside a
    forward pass. The kernel only calls ``fn(*args)``.
    """

    __slots__ = ("fn", "args")

    def __init__(self, fn, args=()):
        self.fn = fn
        self.args = args


class _Once:
    """A tiny awaitable that yields one trap and returns what the kernel sends."""

    __slots__ = ("trap",)

    def __init__(self, trap):
        self.trap = trap

    def __await__(self):
        return (yield self.trap)


def trap(t: Trap):
    """Return an awaitable that hands ``t`` to the kernel."""
    return _Once(t)
