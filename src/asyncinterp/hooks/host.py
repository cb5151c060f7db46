"""The run interface: what points, gradients, source points, tools, the vLLM worker and serving may ask of a run.

The hooks layer sits above the run (``run.py`` imports it, never the other
way round), so it declares here, as a Protocol, the one surface a point or a
tool uses; :class:`asyncinterp.run.Run` implements it. Nothing outside
``run.py`` touches a run's private state. See docs/design.md, "The run
interface", for a worked example of a new kind of point.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

__all__ = ["Firing", "RunHost"]


class Firing(Protocol):
    """One firing of a point in progress: the full batched value and this firing's replacements."""

    point: Any
    value: Any

    def replace(self, group, trap, new, shape_change: bool = False, dtype_change: bool = False) -> None: ...


class RunHost(Protocol):
    """The public interface of a run (the kernel's host), grouped by purpose."""

    model: Any            #: the root envoy being run
    kernel: Any           #: the run's kernel (``None`` before it executes)
    layout: Any           #: how the batch splits into invokes (``views.Layout``)
    context: dict         #: per-run values for interventions and tools (serving: requests, emit sinks)

    # --- points joining the run
    def activate(self, trap, task) -> None:
        """Kernel host: the first wait on ``trap`` in this run; calls ``trap.activate_in(run, task)``."""

    def already_ran(self, trap, current_point) -> bool:
        """Kernel host: has ``trap`` already run in this pass while the model is at ``current_point``?"""

    def install_point(self, point) -> None:
        """Install the torch hook of a module point (``.output`` or ``.inputs`` of an envoy); idempotent."""

    def keep_alive(self, module) -> None:
        """Make ``module`` take torch's hooked path (a no-op pre-hook that is also the cancel checkpoint)."""

    def keep_ancestors(self, envoy) -> None:
        """``keep_alive`` every ancestor of ``envoy`` (so hooks added while they run still fire)."""

    # --- lifetime
    def on_cleanup(self, handle) -> None:
        """``handle.remove()`` is called when the run ends, success or failure, in reverse order."""

    def state(self, owner, factory: Callable[[], Any] = dict) -> Any:
        """Per-run storage of ``owner`` (a class, module or object), made by ``factory`` on first use."""

    # --- firings
    def fire(self, point, value, interrupt: bool = True) -> Any:
        """Deliver ``value`` at ``point`` to its waiting tasks, then to its taps; returns the replacement or ``None``."""

    def firing(self, key) -> Firing | None:
        """The firing of point ``key`` in progress (the model is inside it), or ``None``."""

    def in_firing(self, key) -> bool:
        """Whether point ``key`` is firing now (cheaper than ``firing(key) is not None``)."""

    def tap(self, point, callback) -> None:
        """``callback(value)`` after every firing of ``point`` with the value the model continues with."""

    @property
    def in_adhoc_call(self) -> bool:
        """True while a module call in progress must reach none of this run's points: an intervention's ad hoc
        call, or a call from another thread than the one executing the run (:mod:`.callers`)."""

    # --- requests from interventions
    def replace(self, trap, task, value, shape_change: bool = False, dtype_change: bool = False) -> None: ...
    def skip(self, envoy, task, value) -> None: ...
    def call_adhoc(self, module, args, kwargs) -> Any: ...
    def call_attached(self, envoy, args, kwargs) -> Any: ...
    def request_stop(self, task) -> None:
        """``m.stop()``: the whole run, or only ``task``'s invoke when the run stops per invoke."""
