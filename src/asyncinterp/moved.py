"""Old import paths keep working: modules that moved are still importable under their old names.

Public import paths are a promise. When a module moves (``asyncinterp.envoy``
became ``asyncinterp.hooks.envoy`` when the layers were drawn), its old dotted
name stays in :data:`MOVED`; a finder on ``sys.meta_path`` answers an import of
the old name with the module at its new place, the very same module object, so
``from asyncinterp.models.bundled import smollm2_dir`` and
``import asyncinterp.envoy as e; e.Envoy is asyncinterp.Envoy`` both hold.
Importing the new module happens only when the old name is imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

__all__ = ["MOVED", "install"]

#: old module name -> where it lives now
MOVED = {
    "asyncinterp.aliases": "asyncinterp.hooks.aliases",
    "asyncinterp.batching": "asyncinterp.hooks.batching",
    "asyncinterp.cache": "asyncinterp.tools.cache",
    "asyncinterp.edit": "asyncinterp.tools.edit",
    "asyncinterp.envoy": "asyncinterp.hooks.envoy",
    "asyncinterp.grad": "asyncinterp.hooks.grad",
    "asyncinterp.order": "asyncinterp.hooks.order",
    "asyncinterp.scan": "asyncinterp.tools.scan",
    "asyncinterp.session": "asyncinterp.tools.session",
    "asyncinterp.source": "asyncinterp.hooks.source",
    "asyncinterp.tasks": "asyncinterp.kernel.tasks",
    "asyncinterp.views": "asyncinterp.hooks.views",
    "asyncinterp.models.bundled": "asyncinterp.models.hf.bundled",
    "asyncinterp.models.inputs": "asyncinterp.models.hf.inputs",
    "asyncinterp.models.language": "asyncinterp.models.hf.language",
    "asyncinterp.models.padding": "asyncinterp.models.hf.padding",
    "asyncinterp.models.runs": "asyncinterp.models.hf.runs",
    "asyncinterp.models.taps": "asyncinterp.models.hf.taps",
    "asyncinterp.models.vllm_layout": "asyncinterp.models.vllm.layout",
    "asyncinterp.models.vllm_tp": "asyncinterp.models.vllm.tp",
    "asyncinterp.models.vllm_worker": "asyncinterp.models.vllm.worker",
    # the client reads the sandbox's policy too, and loads no server code (issue 30)
    "asyncinterp.serve.sandbox.policy": "asyncinterp.serve.policy",
}


class _MovedLoader(importlib.abc.Loader):
    """Loads an old name as the module at its new place (the same object, not a copy)."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module):
        # already executed at its new place; importlib set the old name's spec on it: give its own back
        module.__spec__ = self.own_spec


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old names in :data:`MOVED`; every other import goes on as usual."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _MovedLoader(new))


_FINDER = _MovedFinder()


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once), and enter the old names of modules already imported.

    Entering those at once matters where the package holds a name that is also an old module's
    (``asyncinterp.cache`` is the function ``ai.cache``, and was the module ``cache.py``): an import
    found in ``sys.modules`` leaves the package's attribute alone, while one made by a finder would
    overwrite it with the module.
    """
    for old, new in MOVED.items():
        module = sys.modules.get(new)
        if module is not None:
            sys.modules.setdefault(old, module)
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
