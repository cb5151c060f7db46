"""One base for every awaitable hook point: module points, gradients, source points, your own.

A point is a trap (the kernel parks the awaiting task on it) that also knows
how it joins a run. Each kind says two things, and ``run.py`` asks nothing
else of it:

* ``activate_in(run, task)``: called the first time a task of ``run`` waits on
  the point; installs whatever makes the point fire (a module hook, a tap, a
  tensor hook, a rewritten forward), through the run interface only
  (:class:`~asyncinterp.hooks.host.RunHost`).
* ``position``: where the point sits in the model's recorded module call
  order, ``(module, "inputs" | "output")``, or ``None`` when it has no place
  there (gradients). Used to fail an out-of-order await at once; the
  recorded order keeps its answer on the point (``order_cache``).

Everything users do with a point is shared here: ``await point``, the
not-in-a-run error, ``point.replace(v)`` / ``point.set(v)``, and ``point.grad``.
"""

from __future__ import annotations

from ..kernel.errors import NotInRunError
from ..kernel.scheduler import current_run, current_task, running_task
from ..kernel.traps import PointTrap

__all__ = ["Point", "gradient_of"]


def gradient_of(point):
    """The gradient point of ``point``; replaced by :func:`asyncinterp.hooks.grad.grad_point` when it loads.

    (The gradient layer builds on this module, so it registers itself here
    instead of this module importing it.)
    """
    raise RuntimeError("gradient points are unavailable: asyncinterp.hooks.grad was not imported")


class Point(PointTrap):
    """Base class of awaitable points. Subclasses set ``key``, ``read``, ``write`` and implement ``describe``/``activate_in``.

    ``key``: the identity of the firing (derived points share their base's key);
    ``read(value)`` / ``write(new, value)``: map the firing's value to what this
    point shows and a replacement back (``None``: identity).
    """

    __slots__ = ("key", "read", "write", "gradient", "order_cache")

    #: ``(module, "inputs" | "output")`` in the recorded call order, or ``None`` (a subclass sets it)
    position = None

    #: what the not-in-a-run error calls this kind of point
    kind_label = "hook points"

    def __await__(self):
        if running_task() is None:   # current_kernel() is None
            raise NotInRunError(
                f"`await {self.describe()}` outside a run: {self.kind_label} can only be awaited inside an "
                "intervention passed to model.trace / model.atrace / model.generate (or a run's invoke), "
                "which is where the model delivers them.")
        return (yield self)

    def replace(self, value, *, shape_change: bool = False, dtype_change: bool = False) -> None:
        """Replace this point's value for the current invoke (call right after awaiting it).

        The replacement must have the structure, shapes, dtypes and devices of
        the value it replaces. ``shape_change=True`` is the explicit opt-in for
        another shape (only for an invoke that covers the whole batch),
        ``dtype_change=True`` for another dtype.
        """
        task = current_task()
        if task is None:
            raise NotInRunError(f"{self.describe()} can only be replaced from inside an intervention")
        current_run().replace(self, task, value, shape_change, dtype_change)

    set = replace

    @property
    def grad(self):
        """The gradient at this point during a backward pass started in the run (see asyncinterp.hooks.grad)."""
        return _gradients["factory"](self)

    @grad.setter
    def grad(self, value):
        self.grad.replace(value)

    # --------------------------------------------------------------- run side
    def activate_in(self, run, task) -> None:  # pragma: no cover - every kind overrides it
        raise NotImplementedError(f"{type(self).__name__} does not say how it joins a run")


_gradients = {"factory": gradient_of}


def register_gradients(factory) -> None:
    """Make ``point.grad`` return ``factory(point)`` (called once by asyncinterp.hooks.grad)."""
    _gradients["factory"] = factory
