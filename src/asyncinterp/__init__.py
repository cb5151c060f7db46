"""asyncinterp: read and change activations inside PyTorch models with plain async coroutines.

    import asyncinterp as ai
    model = ai.wrap(module)

    async def ablate(m):
        h = await m.layers[3].output
        h[:] = 0
        return await m.output

    out = model.trace(x, ablate)
"""

from . import moved
from .aio import in_loop
from .hooks.envoy import Envoy, HookPoint, point
from .kernel.errors import (
    AsyncInterpError,
    ForeignAwaitError,
    MissedHookPoint,
    ModulePathError,
    NotInRunError,
    OutOfOrderError,
    ReplacementError,
    RunCancelled,
    UnsetFutureError,
)
from .kernel.futures import Future
from .kernel.scheduler import current_run
from .model import Model, wrap
from .job import InvokeSpec, Job, LateBindingError, Trace
from .invoke import Invoke, RunStopped
from .run import Run, StaleEditWarning
from .kernel.tasks import Steps, gather, spawn
from .hooks.views import BatchLayout, Layout
from .hooks.grad import GradPoint, Gradients, backward, gradients
from .tools.cache import Cache, cache
from .tools.scan import ShapeInfo, Shapes, scan
from .tools.session import Session
from .harvesting import harvest
from .hooks import aliases

moved.install()   # old import paths of modules that moved (asyncinterp.envoy, asyncinterp.models.bundled, ...)

__version__ = "0.1.0"

__all__ = [
    "AsyncInterpError", "BatchLayout", "Envoy", "ForeignAwaitError", "Future", "HookPoint", "Invoke", "InvokeSpec",
    "Job", "LateBindingError", "Layout", "MissedHookPoint", "Model", "ModulePathError", "NotInRunError", "OutOfOrderError",
    "ReplacementError", "Run", "RunCancelled", "RunStopped", "StaleEditWarning", "Steps", "Trace", "UnsetFutureError",
    "current_run", "gather", "in_loop", "point", "spawn", "wrap",
    "GradPoint", "Gradients", "backward", "gradients", "Cache", "cache", "ShapeInfo", "Shapes", "scan",
    "Session", "aliases", "harvest",
]


def __getattr__(name):
    # Language-model support needs transformers: imported on first use only.
    if name in ("LanguageModel", "Generation"):
        from .models.hf import language, lora, runs, tp, vision  # noqa: F401 (lora, tp, vision: LanguageModel(peft / TP model / VLM))
        return getattr(language, name, None) or getattr(runs, name)
    if name == "VisionLanguageModel":  # image-text-to-text models (LLaVA, Qwen2-VL) with their processor
        from .models.hf.vision import VisionLanguageModel
        return VisionLanguageModel
    if name in ("DiffusionModel", "DiffusionInvoke"):  # needs diffusers: imported on first use only
        from .models import diffusion
        return getattr(diffusion, name)
    if name == "VLLM":  # needs vllm: imported on first use only
        from .models.vllm import VLLM
        return VLLM
    if name == "remote":  # a served model with the local surface (needs the `remote` extra only)
        import importlib
        return importlib.import_module(".client.remote", __name__).remote
    if name in ("models", "serve"):  # serve: needs the `serve` extra (msgpack, starlette, uvicorn, httpx)
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'asyncinterp' has no attribute {name!r}")
