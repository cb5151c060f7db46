"""Gradients: backward passes inside a run, and gradient hook points.

Tensors handed to interventions are real, so with grad enabled a task can
call ``torch.autograd.grad`` on them directly. This module adds two things on
top of that:

* ``await m.backward(loss)`` (or ``await ai.backward(loss)``) runs
  ``torch.autograd.backward`` from inside an intervention. It goes through a
  :class:`~asyncinterp.kernel.traps.CallTrap`, so the calling task is parked
  while the backward pass runs, and other tasks (other invokes, sub-tasks of
  the same one) are resumed by gradient hooks as the gradients are computed.
* ``await m.layers[3].output.grad`` is a gradient hook point: it suspends
  until the backward pass computes the gradient with respect to that
  module's output, and returns this invoke's rows of it. Editing it in place,
  or replacing it (``point.grad.replace(g)`` / ``m.x.output.grad = g``),
  changes the gradient that flows on to everything before the module.

How it works: awaiting a gradient point taps its forward point (the run's
hook on the module). After each firing of that forward point, the tap
registers a tensor hook (``Tensor.register_hook``) on the value the model
continues with, i.e. after the interventions of that firing. When backward
reaches that tensor, the hook hands the gradient to the kernel like any hook
point firing, and returns what the tasks left (a replacement, or the edited
copy). Tensor hooks are removed with every other hook when the run ends.

Rules (the gradient points' semantics):

* ``x.output.grad`` is the gradient of the backward's root with respect to the
  output tensor of ``x`` (for a tuple output: its first tensor that requires
  grad); ``x.input.grad`` / ``x.inputs.grad`` with respect to the first tensor
  argument that requires grad. A tensor used in several places (a residual
  stream) receives the sum over its uses, as in ``torch.autograd``.
* Await the gradient point before the forward pass has passed its module, or
  right after awaiting the forward point (in the same firing): that is when
  the tensor hook is registered. ``await ai.spawn(m.x.output.grad)`` starts a
  sub-task that waits for it while the intervention goes on to start the
  backward pass.
* The n-th await of a gradient point in a forward pass binds to the n-th time
  the backward passes compute it (one backward per forward: the n-th call of
  the module counted from the end).
"""

from __future__ import annotations

import torch

from ..kernel.errors import NotInRunError, OutOfOrderError
from ..kernel.scheduler import current_kernel
from ..kernel.traps import CallTrap, trap
from .modules import tensor_version
from .points import Point, register_gradients

__all__ = ["GradPoint", "backward", "grad_point"]


class GradPoint(Point):
    """The gradient at a hook point, delivered during a backward pass (``m.x.output.grad``)."""

    __slots__ = ("point", "envoy")

    kind_label = "gradient points (while a backward pass started with `await m.backward(loss)` runs)"

    def __init__(self, point, base=None):
        self.point = point              # the forward hook point this is the gradient of
        self.envoy = point.envoy
        self.key = self if base is None else base
        self.gradient = None
        derived = point.key is not point and getattr(point, "base_kind", None) == "output"
        self.read = point.read if derived else None
        self.write = point.write if derived else None

    def describe(self) -> str:
        return f"{self.point.describe()}.grad"

    def __repr__(self):
        return f"<gradient point {self.describe()}>"

    def order_position(self):
        return None  # backward passes have no place in the forward call order

    # ------------------------------------------------------------ run host side
    def activate_in(self, run, task) -> None:
        if self.envoy.root is not run.model:
            raise NotInRunError(
                f"{self.describe()} belongs to another wrapped model; inside this run await the points of "
                "the envoy your intervention received")
        base = self.point.key
        captured = run.state(GradPoint, set)
        if self.key in captured:
            return
        kernel = run.kernel
        now = kernel.current_point
        passed = kernel.fired.get(base, 0) > 0 or (now is not None and run.already_ran(base, now))
        if passed and run.firing(base) is None:
            raise OutOfOrderError(
                f"`await {self.describe()}`: {base.describe()} already ran in this forward pass, so its "
                "gradient can no longer be captured. Await the gradient point before the model reaches the "
                f"module, or right after `await {self.point.describe()}`; to wait for it while the "
                f"intervention goes on, use `await ai.spawn({self.point.describe()}.grad)`")
        captured.add(self.key)
        run.tap(base, _Capture(run, self.key, base))


class _Capture:
    """Tap on a forward point: registers the gradient hook on each value the model continues with."""

    __slots__ = ("run", "key", "base")

    def __init__(self, run, key, base):
        self.run = run
        self.key = key
        self.base = base

    def __call__(self, value):
        tensor = _first_grad_tensor(value)  # for inputs: value is (args, kwargs)
        if tensor is None:
            raise RuntimeError(
                f"{self.key.describe()} was awaited, but {self.base.describe()} holds no tensor that requires "
                "grad: run the trace with grad enabled (not under torch.no_grad() / inference_mode) and with "
                "parameters or inputs that require grad")
        self.run.on_cleanup(tensor.register_hook(self._on_grad))

    def _on_grad(self, grad):
        run = self.run
        if run.kernel is None or run.kernel.finished:
            return None
        g = grad.clone()
        version = tensor_version(g)
        new = run.fire(self.key, g, interrupt=False)
        if new is not None:
            return new
        if tensor_version(g) != version:   # edited in place
            return g
        return None


def _first_grad_tensor(value):
    if isinstance(value, torch.Tensor):
        return value if value.requires_grad else None
    if isinstance(value, (tuple, list)):
        for v in value:
            t = _first_grad_tensor(v)
            if t is not None:
                return t
        return None
    if isinstance(value, dict):
        for v in value.values():
            t = _first_grad_tensor(v)
            if t is not None:
                return t
    return None


def grad_point(point) -> GradPoint:
    """The gradient point of a forward point (what ``point.grad`` returns; made once per point)."""
    gp = point.gradient
    if gp is None:
        base = point.key
        if base is point:
            gp = GradPoint(point)
        else:
            # a derived point shares its base's gradient firing, like it shares the forward firing
            gp = GradPoint(point, grad_point(base).key)
        point.gradient = gp
    return gp


def backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None):
    """``await ai.backward(loss)``: run ``torch.autograd.backward`` from inside an intervention.

    The calling task waits while the backward pass runs; tasks waiting on
    gradient points are resumed as their gradients are computed, and what
    they change flows on. Arguments are those of ``torch.autograd.backward``.
    """
    if current_kernel() is None:
        raise NotInRunError("`await m.backward(loss)` can only be used inside an intervention; outside a run "
                            "call loss.backward() directly")

    def run_backward():
        torch.autograd.backward(tensors, grad_tensors=grad_tensors, retain_graph=retain_graph,
                                create_graph=create_graph, inputs=inputs)
    return trap(CallTrap(run_backward))


register_gradients(grad_point)
