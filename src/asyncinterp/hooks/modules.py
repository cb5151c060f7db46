"""The one place that reaches into torch's internals (``nn.Module`` dicts, tensor versions).

Two things are worth it on the hot path: reading a module's children dict
without ``named_children()``'s generator, and writing hooks straight into a
module's hook dicts (torch's ``RemovableHandle`` costs ~2 µs per hook, paid
per point per run). Everything else in asyncinterp uses public torch APIs.
"""

from __future__ import annotations

import itertools

__all__ = ["DictHook", "add_forward_hook", "add_forward_pre_hook", "submodules", "instance_forward",
           "set_instance_forward"]


def submodules(module) -> dict:
    """``module``'s direct children by name (the live dict: do not mutate)."""
    return module._modules


_hook_ids = itertools.count(-1, -1)  # negative keys: never collide with torch's own handle ids


class DictHook:
    """A hook written straight into a module's hook dict; ``remove()`` takes it out again."""

    __slots__ = ("hooks", "key", "flags")

    def __init__(self, hooks, key, flags):
        self.hooks = hooks
        self.key = key
        self.flags = flags

    def remove(self):
        self.hooks.pop(self.key, None)
        if self.flags is not None:
            self.flags.pop(self.key, None)


def add_forward_hook(module, fn) -> DictHook:
    """``fn(module, args, output)`` after ``module`` runs (as ``register_forward_hook``)."""
    key = next(_hook_ids)
    hooks = module._forward_hooks
    hooks[key] = fn
    return DictHook(hooks, key, None)


def add_forward_pre_hook(module, fn, with_kwargs: bool = False) -> DictHook:
    """``fn(module, args[, kwargs])`` before ``module`` runs (as ``register_forward_pre_hook``)."""
    key = next(_hook_ids)
    hooks = module._forward_pre_hooks
    hooks[key] = fn
    flags = None
    if with_kwargs:
        flags = module._forward_pre_hooks_with_kwargs
        flags[key] = True
    return DictHook(hooks, key, flags)


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
