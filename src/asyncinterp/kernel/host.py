"""What the kernel needs from its host: the model-side half of a run.

The kernel schedules coroutines and knows nothing about torch, modules or
hooks. Whoever drives it (a run, or a scripted fake in tests) is its *host*:
the host calls ``provide``/``begin_step``/``finish`` as the model executes,
and the kernel calls back the methods of :class:`KernelHost`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .task import Task
    from .traps import PointTrap


class KernelHost(Protocol):
    """The methods the :class:`~asyncinterp.kernel.scheduler.Kernel` calls on its host.

    All are called on the kernel's thread while a task is being stepped:
    ``activate``, ``already_ran`` and ``view_of`` from inside the kernel's
    handling of a ``PointTrap`` (a task awaiting a hook point), before the task
    is parked or resumed; ``parked_holding`` and ``left_step_loop`` when the
    task parks on a future or sub-task, or finishes. A host with nothing to do
    for one of them implements it as a no-op.
    """

    def activate(self, trap: PointTrap, task: Task) -> None:
        """Make sure ``trap``'s point will be delivered: the task is about to wait for it.

        Called every time a task parks on a point (so it must be cheap when
        the point is already active); ``task`` is the waiting task. The host
        installs whatever makes the point fire (e.g. a torch hook, lazily) so
        that it later calls ``kernel.provide(trap.key, get_value, entry)``.

        An exception means the point cannot be delivered in this run (no such
        module, wrong kind of run, ...): the kernel does not park the task but
        throws the exception into it, at the user's ``await``.
        """
        ...

    def already_ran(self, trap: PointTrap, current_point: PointTrap) -> bool:
        """Whether ``trap``'s point has already run in this step, though it never fired.

        Called when a task awaits a point that has not fired in the current
        step while the task was resumed at ``current_point`` (another point
        that is firing now). The host answers from what it knows of the
        model's order (static module order, recorded order, ...): ``True``
        makes the await an ``OutOfOrderError``, ``False`` parks the task.
        Answer ``False`` when unsure. An exception propagates out of the
        kernel (it is a bug of the host, not of the task).
        """
        ...

    def view_of(self, task: Task, trap: PointTrap) -> object:
        """What ``task`` waiting on ``trap`` is resumed with, once the host replaced the entry of a firing.

        ``kernel.provide(key, entry=entry)`` without ``get_value`` resumes each
        waiter with ``entry`` itself (through ``trap.read``); if the host
        replaced ``kernel.entries[key]`` while an earlier waiter ran (a task
        replaced the value), the later waiters get this instead. A host that
        never replaces entries never has it called.
        """
        ...

    def parked_holding(self, task: Task) -> None:
        """``task`` parked on a future or a sub-task while holding the value of the point it was resumed at.

        ``task.last_value`` is that value, ``task.position`` the point. The
        host may watch the task's next resumption (``task.watch_next(watch)``),
        e.g. to warn if the value changed meanwhile.
        """
        ...

    def left_step_loop(self, task: Task) -> None:
        """``task`` finished (without an error) while inside ``m.steps()``: it left the loop with ``break``/``return``.

        Not called once the run has finished. The host may end the
        generation if nobody is left to observe later steps.
        """
        ...
