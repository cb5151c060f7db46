"""The kernel: tasks, traps and the scheduler. Pure Python, no torch, no anyio."""

from .errors import (
    AsyncInterpError,
    ForeignAwaitError,
    MissedHookPoint,
    ModulePathError,
    NotInRunError,
    OutOfOrderError,
    ReplacementError,
    RunCancelled,
    UnsetFutureError,
    await_site,
)
from .futures import Future
from .host import KernelHost
from .scheduler import Kernel, TaskHandle, current_kernel, current_run, current_task
from .task import Task, callable_name, is_async_fn
from .traps import CallTrap, FutureTrap, JoinTrap, PointTrap, SpawnTrap, StepTrap, Trap, trap

__all__ = [
    "AsyncInterpError", "ForeignAwaitError", "MissedHookPoint", "ModulePathError", "NotInRunError",
    "OutOfOrderError", "ReplacementError", "RunCancelled", "UnsetFutureError", "await_site",
    "Future", "Kernel", "KernelHost", "Task", "TaskHandle", "callable_name", "current_kernel", "current_run",
    "current_task", "is_async_fn",
    "CallTrap", "FutureTrap", "JoinTrap", "PointTrap", "SpawnTrap", "StepTrap", "Trap", "trap",
]
