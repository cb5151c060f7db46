"""The one place that reaches into torch's internals (``nn.Module`` dicts, tensor versions).

Two things are worth it on the hot path: reading a module's children dict
without ``named_children()``'s generator, and writing hooks straight into a
module's hook dicts (torch's ``RemovableHandle`` costs ~2 µs per hook, paid
per point per run). Everything else in asyncinterp uses public torch APIs.
"""

from __future__ import annotations

import itertools

__all__ = ["HookSet", "add_forward_hook", "add_forward_pre_hook", "submodules", "instance_forward",
           "set_instance_forward", "tensor_version"]


def submodules(module) -> dict:
    """``module``'s direct children by name (the live dict: do not mutate)."""
    return module._modules


_hook_ids = itertools.count(-1, -1)  # negative keys: never collide with torch's own handle ids


class HookSet:
    """Hooks written straight into modules' hook dicts; ``remove()`` takes them all out again (newest first).

    One per run holds every module hook the run installs, so installing a hook
    costs a dict write and a list append, and removing them one ``pop`` each.
    """

    __slots__ = ("entries",)

    def __init__(self):
        self.entries = []   # (hook dict, key), in the order they were written

    def forward(self, module, fn) -> None:
        """``fn(module, args, output)`` after ``module`` runs (as ``register_forward_hook``)."""
        key = next(_hook_ids)
        hooks = module._forward_hooks
        hooks[key] = fn
        self.entries.append((hooks, key))

    def pre(self, module, fn, with_kwargs: bool = False) -> None:
        """``fn(module, args[, kwargs])`` before ``module`` runs (as ``register_forward_pre_hook``)."""
        key = next(_hook_ids)
        hooks = module._forward_pre_hooks
        hooks[key] = fn
        entries = self.entries
        entries.append((hooks, key))
        if with_kwargs:
            flags = module._forward_pre_hooks_with_kwargs
            flags[key] = True
            entries.append((flags, key))

    def remove(self) -> None:
        entries = self.entries
        for hooks, key in reversed(entries):
            hooks.pop(key, None)
        entries.clear()


def add_forward_hook(module, fn) -> HookSet:
    """``fn(module, args, output)`` after ``module`` runs; returns a handle whose ``remove()`` takes it out."""
    handle = HookSet()
    handle.forward(module, fn)
    return handle


def add_forward_pre_hook(module, fn, with_kwargs: bool = False) -> HookSet:
    """``fn(module, args[, kwargs])`` before ``module`` runs; returns a handle whose ``remove()`` takes it out."""
    handle = HookSet()
    handle.pre(module, fn, with_kwargs)
    return handle


def instance_forward(module):
    """The ``forward`` set on this instance (not its class), or ``None``."""
    return vars(module).get("forward")


def set_instance_forward(module, forward) -> None:
    """Set (``None``: remove) a ``forward`` on this instance, shadowing the class's."""
    if forward is None:
        vars(module).pop("forward", None)
    else:
        vars(module)["forward"] = forward


def tensor_version(tensor) -> int:
    """Autograd's in-place version counter of ``tensor`` (bumped by every in-place edit)."""
    return tensor._version
