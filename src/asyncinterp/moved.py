"""Old import paths keep working: modules that moved are still importable under their old names.

Public import paths are a promise. When a module moves (``asyncinterp.envoy``
became ``asyncinterp.hooks.envoy`` when the layers were drawn), its old dotted
name stays in :data:`MOVED`; a finder on ``sys.meta_path`` answers an import of
the old name with the module at its new place, the very same module object, so
``from asyncinterp.models.bundled import smollm2_dir`` and
``import asyncinterp.envoy as e; e.Envoy is asyncinterp.Envoy`` both hold.
Importing the new module happens only when the old name is imported.

Names that were renamed inside a module (``VLLMRun`` is ``LiveJob``, the supervisor's ``Job`` and the
batcher's ``Request`` are a ``Submission``) are in :data:`RENAMED`, the compatibility table: the module answers an old name through
its module-level ``__getattr__`` (:func:`old_name`), silently, so old imports keep working while the
code, tests and docs use only the one true name. An old name is never bound inside a module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

__all__ = ["MOVED", "RENAMED", "install", "old_name"]

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
    "asyncinterp.serve.sandbox.policy": "asyncinterp.client.policy",
    # serving gets floors (issue 30): the client and the wire format below it, then scheduling, the sandbox,
    # jobs, workers, OpenAI compatibility, HTTP and scale-out
    "asyncinterp.serve.wire": "asyncinterp.client.wire",
    "asyncinterp.serve.capture": "asyncinterp.client.capture",
    "asyncinterp.serve.policy": "asyncinterp.client.policy",
    "asyncinterp.serve.cache_wire": "asyncinterp.client.cache_wire",
    "asyncinterp.serve.protocol": "asyncinterp.client.protocol",
    "asyncinterp.serve.client": "asyncinterp.client.clients",
    "asyncinterp.serve.job_form": "asyncinterp.client.job_form",
    "asyncinterp.serve.remote": "asyncinterp.client.remote",
    "asyncinterp.serve.remote_check": "asyncinterp.client.remote_check",
    "asyncinterp.serve.ray_app": "asyncinterp.serve.scale.ray_app",
    "asyncinterp.serve.replicas": "asyncinterp.serve.scale.replicas",
    "asyncinterp.serve.replica_loss": "asyncinterp.serve.scale.replica_loss",
    "asyncinterp.serve.tp_serve": "asyncinterp.serve.scale.tp_serve",
    "asyncinterp.serve.tp_front": "asyncinterp.serve.scale.tp_front",
    "asyncinterp.serve.tp_ray": "asyncinterp.serve.scale.tp_ray",
    "asyncinterp.serve.app": "asyncinterp.serve.http.app",
    "asyncinterp.serve.capabilities": "asyncinterp.serve.http.capabilities",
    "asyncinterp.serve.metrics": "asyncinterp.serve.http.metrics",
    "asyncinterp.serve.startup": "asyncinterp.serve.http.startup",
    "asyncinterp.serve.openai_compat": "asyncinterp.serve.openai.openai_compat",
    "asyncinterp.serve.choices": "asyncinterp.serve.openai.choices",
    "asyncinterp.serve.logprobs": "asyncinterp.serve.openai.logprobs",
    "asyncinterp.serve.structured": "asyncinterp.serve.openai.structured",
    "asyncinterp.serve.tokenize_api": "asyncinterp.serve.openai.tokenize_api",
    "asyncinterp.serve.model_names": "asyncinterp.serve.openai.model_names",
    "asyncinterp.serve.receipts": "asyncinterp.serve.openai.receipts",
    "asyncinterp.serve.pool": "asyncinterp.serve.workers.pool",
    "asyncinterp.serve.supervisor": "asyncinterp.serve.workers.supervisor",
    "asyncinterp.serve.worker_proc": "asyncinterp.serve.workers.worker_proc",
    "asyncinterp.serve.worker_start": "asyncinterp.serve.workers.worker_start",
    "asyncinterp.serve.worker_results": "asyncinterp.serve.workers.worker_results",
    "asyncinterp.serve.confine": "asyncinterp.serve.workers.confine",
    "asyncinterp.serve.channel": "asyncinterp.serve.workers.channel",
    "asyncinterp.serve.sessions": "asyncinterp.serve.jobs.sessions",
    "asyncinterp.serve.job_wire": "asyncinterp.serve.jobs.job_wire",
    "asyncinterp.serve.dryrun": "asyncinterp.serve.jobs.dryrun",
    "asyncinterp.serve.errors": "asyncinterp.serve.jobs.errors",
    "asyncinterp.serve.jobs_api": "asyncinterp.serve.jobs.jobs_api",
    "asyncinterp.serve.rebuild": "asyncinterp.serve.sandbox.rebuild",
    "asyncinterp.serve.rebuild_sandbox": "asyncinterp.serve.sandbox.rebuild_sandbox",
    "asyncinterp.serve.source_lines": "asyncinterp.serve.sandbox.source_lines",
    "asyncinterp.serve.batcher": "asyncinterp.serve.scheduling.batcher",
    "asyncinterp.serve.requests": "asyncinterp.serve.scheduling.requests",
    "asyncinterp.serve.groups": "asyncinterp.serve.scheduling.submission",
    "asyncinterp.serve.scheduling.groups": "asyncinterp.serve.scheduling.submission",
    "asyncinterp.serve.engine_front": "asyncinterp.serve.scheduling.engine_front",
    "asyncinterp.serve.params": "asyncinterp.serve.scheduling.params",
    "asyncinterp.serve.builtins": "asyncinterp.serve.scheduling.builtins",
    "asyncinterp.serve.worker_failures": "asyncinterp.serve.scheduling.worker_failures",
    "asyncinterp.serve.sampling_fields": "asyncinterp.serve.scheduling.sampling_fields",
}

#: module -> {old name: "module:new name"}: names renamed in place, answered by :func:`old_name`
RENAMED = {
    # the vLLM driver's execution of a job in the live engine loop is not a Run (a kernel's host)
    "asyncinterp.models.vllm": {"VLLMRun": "asyncinterp.models.vllm.jobs:LiveJob"},
    "asyncinterp.models.vllm.driver": {"VLLMRun": "asyncinterp.models.vllm.jobs:LiveJob"},
    # a request tracked across worker processes, before ``asyncinterp.Job`` meant the description of the work
    "asyncinterp.serve.workers.supervisor": {"Job": "asyncinterp.serve.scheduling.submission:Submission"},
    # one submission type replaced the request, the group and its members, and the worker pool's ticket (issue 30)
    "asyncinterp.serve.scheduling.requests": {"Request": "asyncinterp.serve.scheduling.submission:Submission"},
    "asyncinterp.serve.scheduling.submission": {"Group": "asyncinterp.serve.scheduling.submission:Submission",
                                                "Member": "asyncinterp.serve.scheduling.submission:ServedInvoke"},
    "asyncinterp.serve.workers.pool": {"Ticket": "asyncinterp.serve.scheduling.submission:Submission"},
    # the ranks of a tensor-parallel launch on Ray ("job" means the description of the work)
    "asyncinterp.distributed.ray_ranks": {"RayJob": "asyncinterp.distributed.ray_ranks:RayLaunched"},
    # the scan's execution, before jobs and engines
    "asyncinterp.tools.scan": {"FakeForward": "asyncinterp.tools.scan:FakeExecution"},
    # the sandbox's policy moved to the client (issue 30), under the names the client uses
    "asyncinterp.serve.sandbox": {"POINT_NAMES": "asyncinterp.client.policy:ASSIGNABLE_POINTS",
                                  "DENIED_ATTRS": "asyncinterp.client.policy:REFUSED_ATTRIBUTES",
                                  "DENIED_NAMES": "asyncinterp.client.policy:REFUSED_BUILTINS"},
}


def old_name(module: str, name: str):
    """The object an old ``name`` of ``module`` stands for now (a module's ``__getattr__`` calls this).

    Raises ``AttributeError`` as a module does for a name it does not have, so ``hasattr`` and
    ``from module import name`` behave as usual for every other name.
    """
    target = RENAMED.get(module, {}).get(name)
    if target is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    where, new = target.split(":")
    return getattr(importlib.import_module(where), new)


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
