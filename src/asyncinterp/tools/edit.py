"""Persistent edits: interventions that apply to every later run of a model until removed.

``edited = model.edit(fn)`` returns a new wrapped model over the same
``nn.Module`` (nothing on the module changes). Every run of ``edited`` --
``trace``, invokes, ``generate``, ``atrace`` -- runs ``fn(m)`` on every
forward pass (each generation step), before the run's own interventions, on
the whole batch. ``model.edit(fn, inplace=True)`` edits ``model`` itself.
``remove_edits()`` removes them (all, or one function); since an edit is only
a task of each run, removing it restores the exact original outputs.

How it works: a job of an edited model (made by ``model.trace()``,
``generate``, ``atrace``, serving) starts with one background invoke without
input (so it sees every row), holding one task per edit; the job takes the
edits the model has when the job is made, and its own invokes come after, so
their indices never change. Invoke order decides who is resumed first at a
shared hook point, so the run's own interventions see the edited values. Each
edit task loops over the run's steps (``async for _ in m.steps()``) and calls
the edit once per step.
"""

from __future__ import annotations

import copy

from ..hooks import aliases
from ..hooks.envoy import Envoy
from ..job import check_intervention, is_async_fn
from ..kernel.traps import PointTrap

__all__ = ["clone", "edit", "remove_edits"]


def _check(fn):
    """``check_intervention``, stricter: an edit is re-run every step, so it must be an ``async def`` itself."""
    try:
        check_intervention(fn)
    except TypeError as e:
        raise TypeError(f"model.edit expects an `async def fn(m)` intervention: {e}") from None
    if not is_async_fn(fn):
        raise TypeError(f"{getattr(fn, '__qualname__', fn)!r} is a plain function; an edit is an `async def fn(m)` "
                        "intervention like those passed to model.trace")


def edit(model, fn, inplace: bool = False):
    """Return ``model`` with ``fn`` applied on every forward pass of every later run (see module docs)."""
    _check(fn)
    target = model if inplace else clone(model)
    target.edits = target.edits + (fn,)
    return target


def remove_edits(model, fn=None) -> None:
    """Remove every edit of ``model`` (or only ``fn``)."""
    edits = model.edits
    if fn is None:
        model.edits = ()
        return
    if fn not in edits:
        raise ValueError(f"{getattr(fn, '__qualname__', fn)!r} is not an edit of this model; its edits are "
                         f"{[getattr(e, '__qualname__', e) for e in edits]}")
    kept = list(edits)
    kept.remove(fn)
    model.edits = kept


# ------------------------------------------------------------------ cloning
def clone(model):
    """A new root envoy over the same module and state, with its own envoy tree."""
    new = model.reattached(None, None)   # its own root
    memo = {}
    for k, v in list(vars(new).items()):
        if k not in ("root", "module", "run_lock", "parent", "_children", "points", "attachments"):
            object.__setattr__(new, k, _reroot(v, model, new, memo))
    aliases.copy_aliases(model, new)
    object.__setattr__(new, "attachments", {})
    for name, attached in model.attachments.items():   # attached modules come along, on the new root
        new.attach(name, attached.module)
    return new


def _reroot(value, old, new, memo):
    """Copies of envoys/points hanging off ``old`` (e.g. generation tap points), re-rooted on ``new``."""
    if id(value) in memo:
        return memo[id(value)]
    out = value
    if isinstance(value, Envoy) and value is not old and value.root is old:
        out = value.reattached(new, new if value.parent is old else value.parent)
    elif isinstance(value, PointTrap) and getattr(value, "envoy", None) is not None \
            and isinstance(value.envoy, Envoy) and value.envoy.root is old:
        p = copy.copy(value)
        p.envoy = _reroot(value.envoy, old, new, memo)
        if getattr(value, "key", None) is value:
            p.key = p
        out = p
    elif type(value) is dict:
        out = {k: _reroot(v, old, new, memo) for k, v in value.items()}
    memo[id(value)] = out
    return out
