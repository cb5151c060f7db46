"""Gradients for submitted code: ``torch.autograd.grad``, ``await m.backward(loss)`` and ``.grad`` points.

Why a module of its own: on a server, one forward pass holds several
tenants' rows, so one autograd graph holds them too. Locally a backward
pass is the user's business; here every backward that submitted code starts
must leave its batch-mates exactly as if it had not run. The rules, all
enforced here:

* **Nothing is freed, nothing accumulates.** Every backward runs with
  ``retain_graph=True`` (a batch-mate may still need the graph) and as
  ``torch.autograd.grad`` towards named tensors, never
  ``torch.autograd.backward``: no parameter's ``.grad`` of the served model
  changes. ``create_graph=True`` (higher-order gradients) is refused.
* **A backward resumes only its own request.** Gradient hooks sit on the
  shared tensors, so a batch-mate's backward fires them too. A backward
  started by submitted code runs with its request marked as the owner
  (:func:`backward_owner`); a :class:`SafeGradPoint` whose hook fires in
  another request's backward (or in trusted code's) lets it pass without
  running a line of the waiting code and waits for the next computation.
  Its gradient is this request's rows of d(own loss)/d(point), as when it
  runs alone.
* **Only own tensors.** ``torch.autograd.grad`` takes outputs and inputs that
  the request holds (its private copies and what it computed from them).
  In a forward pass with autograd on, a private copy stays connected to the
  graph and the model continues with it for the request's rows (see
  :meth:`.driver.TaskState.flush`), so ``torch.autograd.grad(out, h)`` with
  ``h = await m.x.output`` works as locally; the gradient reaching ``h``
  comes from the request's own rows only.
* **On the compute budget.** The time a backward takes counts on the
  request's clock; past the budget the request stops there.

Requests whose source names a gradient (``policy.GRADIENT_NAMES``) run in
forward passes with autograd on, batched only with each other
(:func:`needs_grad`); the batcher reads ``fn.needs_grad``.
"""

from __future__ import annotations

import ast
import contextlib
import threading

import torch

from ...hooks.grad import _first_grad_tensor
from ...kernel.errors import NotInRunError, OutOfOrderError
from ...kernel.scheduler import current_kernel, current_task
from ...kernel.traps import CallTrap, trap
from ...client import policy
from .driver import Pending, current_state
from .errors import SandboxRefused, SandboxTimeout, refuse, user_line
from .tensors import DisableTorchFunction, PrivateTensor, adopt
from .values import sanitize

_LOCAL = threading.local()

#: the error a gradient request gets from a server whose engine runs without autograd (vLLM)
NO_GRADIENTS_ON_VLLM = (
    "gradients are not available on this server: its engine (vLLM) runs the model under "
    "torch.inference_mode, which records no autograd graph. Use torch.autograd.grad, m.backward and .grad points "
    "against a server of a transformers model (asyncinterp serve without --engine vllm)")


def needs_grad(tree: ast.AST) -> bool:
    """Whether checked source uses gradients (an attribute named in ``policy.GRADIENT_NAMES``)."""
    return any(isinstance(n, ast.Attribute) and n.attr in policy.GRADIENT_NAMES for n in ast.walk(tree))


def backward_owner():
    """The clock of the request whose backward pass runs on this thread now (``None``: none, or trusted code)."""
    return getattr(_LOCAL, "owner", None)


@contextlib.contextmanager
def _owned(clock):
    """Run a backward pass as ``clock``'s request: its time on that clock, its gradient points only."""
    previous = getattr(_LOCAL, "owner", None)
    _LOCAL.owner = clock
    if clock is not None:
        clock.resume()
    try:
        yield
    finally:
        _LOCAL.owner = previous
        if clock is not None:
            clock.pause()
    if clock is not None:
        clock.check()       # a backward that took the request past its budget stops it here


def _own_tensors(value, what: str) -> list:
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    for t in items:
        if type(t) is not PrivateTensor:
            raise TypeError(f"{what} must be tensors computed by this request (got a {type(t).__name__}) "
                            f"({user_line()})")
    return items


def _no_graph(what: str) -> RuntimeError:
    return RuntimeError(
        f"{what} has no autograd graph ({user_line()}): gradients exist only for values of a forward pass "
        "(model.trace, not generation), awaited inside the intervention, and what is computed from them")


def autograd_grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False, allow_unused=None,
                  materialize_grads=False):
    """``torch.autograd.grad`` for submitted code: own tensors only, graph retained, private results."""
    if create_graph:
        raise refuse("torch.autograd.grad(..., create_graph=True)", "higher-order gradients are not offered")
    outs = _own_tensors(outputs, "the outputs of torch.autograd.grad")
    ins = _own_tensors(inputs, "the inputs of torch.autograd.grad")
    gos = None
    if grad_outputs is not None:
        gos = [g if g is None else _own_tensors(g, "grad_outputs")[0]
               for g in (grad_outputs if isinstance(grad_outputs, (list, tuple)) else [grad_outputs])]
    for t in outs:
        if not t.requires_grad:
            raise _no_graph("an output of torch.autograd.grad")
    state = current_state()
    with _owned(state.clock if state is not None else None), DisableTorchFunction():
        got = torch.autograd.grad(outs, ins, grad_outputs=gos, retain_graph=True, create_graph=False,
                                  allow_unused=allow_unused, materialize_grads=materialize_grads)
    return adopt(tuple(g if g is None else g.detach() for g in got))


class _Targets:
    """Per run: for each request (its clock), the tensors its gradient points hook (where its backwards go)."""

    __slots__ = ("by_clock",)

    def __init__(self):
        self.by_clock = {}


def _record_target(run, clock, base):
    """Remember, for ``m.backward``, the tensor that the model continues with at ``base`` (each firing)."""
    targets = run.state(_Targets, _Targets).by_clock.setdefault(clock, [])

    def record(value):
        t = _first_grad_tensor(value)
        if t is not None and not any(t is u for u in targets):
            targets.append(t)
    run.tap(base, record)


def backward_of(envoy):
    """``m.backward`` for submitted code: ``await m.backward(loss)`` resumes this request's ``.grad`` points."""

    def backward(loss, gradient=None, retain_graph=None, create_graph=False, grad_tensors=None):
        """As ``await m.backward(loss)`` locally; the graph is always retained (``retain_graph`` changes nothing)."""
        if create_graph:
            raise refuse("m.backward(..., create_graph=True)", "higher-order gradients are not offered")
        gradient = gradient if gradient is not None else grad_tensors
        kernel = current_kernel()
        if kernel is None:
            raise NotInRunError(f"`await m.backward(loss)` can only be used inside an intervention ({user_line()})")
        state = current_state()
        clock = state.clock if state is not None else None
        (root,) = _own_tensors(loss, "the loss of m.backward")
        grad = None if gradient is None else _own_tensors(gradient, "the gradient of m.backward")[0]
        if not root.requires_grad:
            raise _no_graph("the loss of m.backward")
        run = kernel.host

        def run_backward():
            kernel.drain()   # sub-tasks spawned just before the backward register their waits first
            targets = run.state(_Targets, _Targets).by_clock.get(clock, [])
            if not targets:
                return None  # no gradient point of this request waits: nothing to compute (no .grad accumulates)
            with _owned(clock), DisableTorchFunction():
                torch.autograd.grad(root, targets, grad_outputs=grad, retain_graph=True, allow_unused=True)
            return None
        return trap(CallTrap(run_backward))
    return backward


class _Book:
    """Per run: for each request (its clock) and gradient point, how many awaits it made and which
    computations of that gradient (global numbers) were its own backward's."""

    __slots__ = ("entries",)

    def __init__(self):
        self.entries = {}

    def of(self, clock, key) -> dict:
        return self.entries.setdefault((clock, key), {"awaits": 0, "own": []})


class SafeGradPoint:
    """A gradient point for submitted code: fires only in the request's own backward passes.

    Awaiting it gives a private copy of this request's rows of the gradient;
    editing that copy in place, or ``.replace(g)``, changes the gradient that
    flows on in this request's backward only. Binding is per request: its
    n-th await of a gradient point binds to the n-th time *its own* backward
    passes compute that gradient, whatever its batch-mates' backward passes
    do in between (each await watches every computation and takes its own).
    """

    __slots__ = ("_safe",)

    def __init__(self, safe_point):
        object.__setattr__(self, "_safe", safe_point)   # a SafePoint over the GradPoint

    def __await__(self):
        safe = object.__getattribute__(self, "_safe")
        gp = object.__getattribute__(safe, "_point")
        state = current_state()
        clock = state.clock if state is not None else None
        kernel, task = current_kernel(), current_task()
        if kernel is None or task is None or clock is None or getattr(gp, "point", None) is None:
            return (yield from safe.__await__())     # outside a run: the local point's own error
        run = kernel.host
        _record_target(run, clock, gp.point.key)
        key = gp.key
        book = run.state(_Book, _Book).of(clock, key)
        ordinal = book["awaits"]
        book["awaits"] += 1
        if len(book["own"]) > ordinal:
            raise OutOfOrderError(f"`await {gp.describe()}` is this request's await #{ordinal + 1} of that gradient, "
                                  f"but its backward passes have computed it {len(book['own'])} time(s) already "
                                  f"({user_line()}); await gradient points (or `ai.spawn` them) before the backward")
        while True:
            task.bind_next(key, kernel.fired.get(key, 0))    # the very next computation, whoever starts it
            raw = yield gp
            if backward_owner() is not clock:
                continue       # a batch-mate's backward (or trusted code's): not ours, no line of ours runs
            number = kernel.fired.get(key, 0)
            if number not in book["own"]:
                book["own"].append(number)
            if book["own"].index(number) == ordinal:
                return _delivered(gp, raw, state)

    def replace(self, value):
        return object.__getattribute__(self, "_safe").replace(value)

    set = replace

    def __getattr__(self, item):
        raise AttributeError("gradient points offer only await, .replace(g) and .set(g) to submitted code")

    def __setattr__(self, key, value):
        raise AttributeError("gradient points are read-only")

    def __repr__(self):
        return repr(object.__getattribute__(self, "_safe"))


def _delivered(gp, raw, state):
    """What the awaiting code gets: a private copy, its in-place edits written back while the gradient flows."""
    leaves = []
    value = sanitize(raw, leaves=leaves)
    if leaves:
        state.pending.append(Pending(gp, raw, leaves))
    return value


def check_no_grad_refusal(program, engine_kind: str) -> None:
    """Refuse a gradient request on an engine without autograd (:data:`NO_GRADIENTS_ON_VLLM`)."""
    if getattr(program, "needs_grad", False) and engine_kind == "vllm":
        raise SandboxRefused(NO_GRADIENTS_ON_VLLM)


__all__ = ["NO_GRADIENTS_ON_VLLM", "SafeGradPoint", "SandboxTimeout", "autograd_grad", "backward_of",
           "backward_owner", "check_no_grad_refusal", "needs_grad"]
