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
* Binding: within one intervention (its task and every sub-task it spawns,
  ``ai.gather`` included) the awaits of a gradient point bind, in the order
  they are made, to the successive times the backward passes of the forward
  pass compute that gradient: with two backward passes through one forward,
  ``g1 = await ai.spawn(p.grad); g2 = await ai.spawn(p.grad)`` gives the
  gradient of the first and of the second (one backward per forward: the n-th
  call of the module counted from the end). Separate interventions count
  separately. An await whose computation already happened raises
  ``OutOfOrderError``; one that never comes raises ``MissedHookPoint`` naming
  ``await m.backward(loss)``.
* ``await ai.gradients(...).backward(loss)`` (:class:`Gradients`) collects
  the gradients at several points in one await.
"""

from __future__ import annotations

import torch

from ..kernel.errors import NotInRunError, OutOfOrderError
from ..kernel.scheduler import TaskHandle, current_kernel, current_task
from ..kernel.traps import CallTrap, trap
from .modules import tensor_version
from .points import Point, register_gradients

__all__ = ["GradPoint", "Gradients", "backward", "grad_point", "gradients"]


class GradPoint(Point):
    """The gradient at a hook point, delivered during a backward pass (``m.x.output.grad``)."""

    __slots__ = ("point", "envoy")

    kind_label = "gradient points (while a backward pass started with `await m.backward(loss)` runs)"

    #: appended to the MissedHookPoint message when the point never fired
    hint = ("; a gradient point fires only while a backward pass runs: start one inside the same run with "
            "`await m.backward(loss)` (or use `await ai.gradients(points).backward(loss)`)")

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

    # position stays None: backward passes have no place in the forward call order

    def __await__(self):
        kernel = current_kernel()
        task = current_task()
        if kernel is None or task is None:
            raise NotInRunError(
                f"`await {self.describe()}` outside a run: {self.kind_label} can only be awaited inside an "
                "intervention passed to model.trace / model.atrace / model.generate (or a run's invoke)")
        # Binding: the n-th await of this gradient within one intervention (root task and its sub-tasks,
        # in await order) binds to the n-th time the backward passes compute it. The kernel binds a
        # task's wait to call `task.consumed[key]`; sub-tasks copy their parent's count, so without this
        # two `ai.spawn(p.grad)` (or `ai.gather(p.grad, p.grad)`) would both bind to the first backward.
        key = self.key
        root = task
        while root.parent is not None:
            root = root.parent
        counts = kernel.host.state(_Bindings, _Bindings).counts
        slot = (root, key, kernel.step)
        n = counts.get(slot, 0)
        counts[slot] = n + 1
        done = kernel.fired.get(key, 0)
        if done > n:
            raise OutOfOrderError(
                f"`await {self.describe()}` is this intervention's await #{n + 1} of that gradient, so it binds "
                f"to computation #{n + 1} of it, but the backward passes have already computed it {done} "
                "time(s). Await gradient points (or `ai.spawn` them) before the backward pass that computes "
                "them starts")
        task.bind_next(key, n)
        return (yield self)   # a missed gradient point's error carries self.hint (the scheduler appends it)

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
        if run.kernel.has_run(base) and not run.in_firing(base):
            raise OutOfOrderError(
                f"`await {self.describe()}`: {base.describe()} already ran in this forward pass, so its "
                "gradient can no longer be captured. Await the gradient point before the model reaches the "
                f"module, or right after `await {self.point.describe()}`; to wait for it while the "
                f"intervention goes on, use `await ai.spawn({self.point.describe()}.grad)`")
        captured.add(self.key)
        run.tap(base, _Capture(run, self.key, base))


class _Bindings:
    """Per run: how many awaits of each gradient point each intervention made, per step."""

    __slots__ = ("counts",)

    def __init__(self):
        self.counts = {}


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

    kernel = current_kernel()

    def run_backward():
        kernel.drain()   # sub-tasks spawned just before the backward register their waits first
        torch.autograd.backward(tensors, grad_tensors=grad_tensors, retain_graph=retain_graph,
                                create_graph=create_graph, inputs=inputs)
    return trap(CallTrap(run_backward))


class Gradients:
    """The gradients at several points from one backward pass, in one await.

    ``grads = ai.gradients(m.layers[1].output, m.layers[2].output)`` is a plain
    call made inside an intervention *before the model has passed those
    points* (or right after awaiting one of them): it registers the gradient
    captures, as awaiting their ``.grad`` would. After the forward pass,
    ``g1, g2 = await grads.backward(loss)`` runs one backward pass from ``loss``
    and returns this invoke's rows of d(loss)/d(each point's value as the model
    continued with it), equal to ``torch.autograd.grad(loss, those values)``.

    Like ``torch.autograd.grad`` it accumulates nothing into parameters'
    ``.grad`` (only the graph between ``loss`` and the points is computed).
    ``edit={point: fn}`` changes the gradient that flows on at ``point``:
    ``fn(g)`` edits ``g`` in place or returns a replacement; the gradients
    returned for earlier points include the edit, the one returned for
    ``point`` itself is the gradient that reached it (before ``fn``). Tasks
    waiting on ``.grad`` points are resumed during this backward pass as
    during ``await m.backward(loss)``. One ``backward`` per ``gradients(...)``
    call; each point must fire once in the pass.
    """

    __slots__ = ("points", "_run", "_group", "_values", "_used")

    def __init__(self, points):
        kernel, task = current_kernel(), current_task()
        if kernel is None or task is None:
            raise NotInRunError("ai.gradients(...) can only be used inside an intervention; outside a run use "
                                "torch.autograd.grad")
        if not points:
            raise TypeError("ai.gradients(...) needs at least one hook point, e.g. ai.gradients(m.layers[1].output)")
        run = kernel.host
        self.points = tuple(_forward_point(p) for p in points)
        self._run = run
        self._group = task.group
        self._values = {}     # base key -> [(step, tensor the model continued with)]
        self._used = False
        for p in self.points:
            run.activate(grad_point(p), task)      # the gradient capture (OutOfOrderError if already passed)
            base = p.key
            if base not in self._values:
                self._values[base] = []
                run.tap(base, self._recorder(base))

    def _recorder(self, base):
        values, run = self._values[base], self._run

        def record(value):
            t = _first_grad_tensor(value)
            if t is not None:
                values.append((run.kernel.step, t))
        return record

    def __repr__(self):
        return f"<ai.gradients({', '.join(p.describe() for p in self.points)})>"

    async def backward(self, loss, *, edit=None, retain_graph=None, create_graph=False):
        """Backward from ``loss``; returns this invoke's rows of the gradient at each point (a tuple)."""
        if self._used:
            raise RuntimeError(f"{self!r}.backward(...) was already called; call ai.gradients(...) again (before "
                               "the forward pass reaches the points) for another backward pass")
        self._used = True
        kernel = current_kernel()
        if kernel is None or kernel.host is not self._run:
            raise NotInRunError(f"{self!r}.backward(...) must be awaited inside the run that made it")
        edits = {}
        for p, fn in (edit or {}).items():
            fp = _forward_point(p)
            if not any(fp is q for q in self.points):
                raise ValueError(f"edit= names {fp.describe()}, which is not among the points of {self!r}")
            if not callable(fn):
                raise TypeError(f"edit[{fp.describe()}] must be a function g -> None (edits in place) or a new "
                                f"gradient, got {fn!r}")
            edits[fp] = fn
        step = kernel.step
        inputs = []
        for p in self.points:
            ts = [t for s, t in self._values[p.key] if s == step]
            if not ts and self._run.in_firing(p.key):
                raise RuntimeError(f"{p.describe()} is firing now, and the value the model continues with is "
                                   "known only when its firing ends: await a later point (e.g. m.output) before "
                                   f"{self!r}.backward(loss)")
            if not ts:
                raise RuntimeError(f"{p.describe()} has not run in this forward pass: await "
                                   f"{self!r}.backward(loss) after the forward pass has computed the points")
            if len(ts) > 1:
                raise RuntimeError(f"{p.describe()} ran {len(ts)} times in this forward pass; ai.gradients "
                                   f"needs points that fire once: await {p.describe()}.grad once per call instead")
            if not any(ts[0] is t for t in inputs):
                inputs.append(ts[0])
        task = current_task()
        handles = [TaskHandle(kernel.spawn(_collect(p, edits.get(p)), task.group,
                                           name=f"gradients[{p.describe()}]", parent=task))
                   for p in self.points]

        def run_grad():
            kernel.drain()   # the collectors register their waits before autograd starts
            torch.autograd.grad(loss, inputs, retain_graph=retain_graph, create_graph=create_graph,
                                allow_unused=True)
        await trap(CallTrap(run_grad))
        missing = [p for p, h in zip(self.points, handles) if not h.done()]
        for h in handles:
            if not h.done():
                h.cancel()
        if missing:
            raise ValueError(f"the loss does not depend on {', '.join(p.describe() for p in missing)} (no "
                             "gradient reached it in this backward pass)")
        return tuple([await h for h in handles])


async def _collect(point, fn):
    gp = grad_point(point)
    kernel = current_kernel()
    # bind to the next computation of this gradient (the backward pass about to run), whatever
    # this intervention awaited before
    root = current_task()
    while root.parent is not None:
        root = root.parent
    counts = kernel.host.state(_Bindings, _Bindings).counts
    slot = (root, gp.key, kernel.step)
    counts[slot] = max(counts.get(slot, 0), kernel.fired.get(gp.key, 0))
    g = await gp
    if fn is None:
        return g
    seen = g.clone()
    new = fn(g)
    if new is not None:
        gp.replace(new)
    return seen


def _forward_point(p):
    if isinstance(p, GradPoint):
        p = p.point
    if not isinstance(p, Point):
        raise TypeError(f"ai.gradients takes hook points such as m.layers[1].output, got {p!r}; for gradients "
                        "with respect to tensors you hold, use torch.autograd.grad")
    return p


def gradients(*points) -> Gradients:
    """``ai.gradients(m.a.output, m.b.output)``: register gradient captures now; ``await .backward(loss)`` later.

    See :class:`Gradients`.
    """
    return Gradients(points)


register_gradients(grad_point)
