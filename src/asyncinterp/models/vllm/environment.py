"""What an in-process vLLM engine needs from its surroundings before and after it runs hooks.

Module hooks only fire in an eager model whose engine core runs in this
process, so :class:`~.driver.VLLM` refuses the settings that make them
impossible before vLLM starts (:func:`check_engine_kwargs`,
:func:`prepare_environment`) and checks the engine it got
(:func:`check_engine`). An engine also changes process-wide torch settings
that must be given back when the last one closes (:class:`TorchSettingsGuard`).
Under tensor parallelism the driver mirrors the workers' module tree with
empty modules (:func:`skeleton`). None of this is needed once a job runs.
"""

from __future__ import annotations

import os
import threading

import torch

__all__ = ["COMPILE_HINT", "HooksUnavailableError", "TorchSettingsGuard", "adopt_torch_threads", "check_engine",
           "check_engine_kwargs", "keep_torch_threads",
           "prepare_environment", "restore_environment", "shutdown_engine", "skeleton"]


class HooksUnavailableError(RuntimeError):
    """The engine's settings make module hooks impossible (compiled model, engine core in another process)."""


COMPILE_HINT = (
    "asyncinterp reaches vLLM's layers through PyTorch module hooks, which only fire when the model runs "
    "eagerly: keep enforce_eager=True (the default of ai.VLLM) and do not pass a compilation_config that "
    "compiles the model (torch.compile / CUDA graphs bypass the hooks)")


class TorchSettingsGuard:
    """Give back the process-wide torch settings a vLLM engine changes, once the last engine is closed.

    vLLM's CPU worker replaces ``torch.set_num_threads`` (process-wide) with a
    function that only logs a warning, so that nothing changes the thread
    binding its attention kernels were set up with, and it sets the float32
    matmul precision of oneDNN (and CUDA) from ``"none"`` to ``"ieee"``. That
    is right while an engine runs in this process, but it outlives the
    engine: afterwards the user's own ``torch.set_num_threads(n)`` would
    silently do nothing, and their matmuls would run under vLLM's settings.
    """

    original = torch.set_num_threads   # captured before any engine of ours replaced it
    #: (module path under torch.backends, attribute) of the settings restored at the last close
    SETTINGS = (("mkldnn.matmul", "fp32_precision"), ("mkldnn.conv", "fp32_precision"),
                ("mkldnn.rnn", "fp32_precision"), ("cuda.matmul", "fp32_precision"),
                ("cudnn.conv", "fp32_precision"), ("cudnn.rnn", "fp32_precision"))
    lock = threading.Lock()
    engines = 0
    saved = ()   # (holder, attribute, value) of each setting, taken when the first engine opened

    @classmethod
    def opened(cls) -> None:
        with cls.lock:
            if cls.engines == 0:
                saved = []
                for path, attr in cls.SETTINGS:
                    holder = torch.backends
                    for part in path.split("."):
                        holder = getattr(holder, part, None)
                    if holder is not None and hasattr(holder, attr):
                        saved.append((holder, attr, getattr(holder, attr)))
                cls.saved = tuple(saved)
            cls.engines += 1

    @classmethod
    def closed(cls) -> None:
        with cls.lock:
            cls.engines -= 1
            if cls.engines:
                return
            if torch.set_num_threads is not cls.original:
                torch.set_num_threads = cls.original
            for holder, attr, value in cls.saved:
                if getattr(holder, attr) != value:
                    setattr(holder, attr, value)


def check_engine_kwargs(kw: dict) -> dict:
    """``vllm.LLM``'s keywords with ``enforce_eager`` on; refuse what would bypass or break the hooks."""
    kw = dict(kw)
    if kw.get("enforce_eager") is False:
        raise HooksUnavailableError(f"enforce_eager=False was given. {COMPILE_HINT}.")
    kw["enforce_eager"] = True
    cc = kw.get("compilation_config")
    if cc is not None:
        level = cc if isinstance(cc, int) else (cc.get("mode", cc.get("level")) if isinstance(cc, dict)
                                                 else getattr(cc, "mode", None))
        if level not in (None, 0) and str(level).split(".")[-1].upper() not in ("NONE", "0"):
            raise HooksUnavailableError(f"compilation_config={cc!r} compiles the model. {COMPILE_HINT}.")
    if kw.get("speculative_config"):
        raise HooksUnavailableError("speculative decoding is not supported: it changes the per-step token "
                                    "layout the per-request views rely on")
    if int(kw.get("pipeline_parallel_size", 1) or 1) > 1:
        raise NotImplementedError("pipeline parallelism is not supported (tensor parallelism is)")
    if int(kw.get("data_parallel_size", 1) or 1) > 1:
        raise NotImplementedError("data parallelism is not supported (tensor parallelism is)")
    return kw


def prepare_environment(tp: int) -> dict:
    """Keep vLLM's engine core in this process; under TP on CPU, bind each worker's threads to its own cores.

    Returns the variables set only for this engine's start (:func:`restore_environment` takes them back once
    the engine's workers have read them): a later engine with another TP size must not inherit a binding
    meant for this one (a TP=1 engine bound to core 0 alone builds its attention metadata for one thread and
    runs it with two).
    """
    value = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    if value not in (None, "0"):
        raise HooksUnavailableError(
            f"VLLM_ENABLE_V1_MULTIPROCESSING={value} runs vLLM's engine core in another process, out of reach "
            "of asyncinterp's hooks; unset it or set it to 0 (ai.VLLM sets 0 when it is unset)")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    temporary = {}
    if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ and not torch.cuda.is_available():
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
        if len(cores) >= tp:
            per = len(cores) // tp
            chunks = [cores[i * per:(i + 1) * per] for i in range(tp)]
            temporary["VLLM_CPU_OMP_THREADS_BIND"] = os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                f"{c[0]}-{c[-1]}" if len(c) > 1 else str(c[0]) for c in chunks)
    return temporary


def restore_environment(temporary: dict) -> None:
    """Unset what :func:`prepare_environment` set for one engine's start, unless something changed it since."""
    for name, value in temporary.items():
        if os.environ.get(name) == value:
            del os.environ[name]


def adopt_torch_threads() -> None:
    """Give the calling (new) thread torch's OpenMP thread count before any of vLLM's kernels run in it.

    A thread not made by OpenMP starts with the process's default count (the
    number of cores); torch lowers it to its own setting only at the first
    torch parallel op in that thread. vLLM's CPU attention reads the count
    twice per step, once when it builds its metadata and once in the kernel,
    and refuses a mismatch ("metadata->thread_num == thread_num (2 vs. 1)").
    In the engine loop's thread the first read would otherwise see the
    default and the second torch's setting, whenever the two differ (after
    ``torch.set_num_threads(1)``, or after a tensor-parallel engine started).
    """
    torch.get_num_threads()   # runs torch's lazy per-thread initialisation


def keep_torch_threads(threads: int) -> None:
    """Give this process back ``threads`` torch threads after a tensor-parallel engine started.

    vLLM's multiprocessing executor lowers its parent process to one torch
    thread (the parent only schedules, in vLLM's own server); here the parent
    is the user's process, whose own torch work must not silently slow down.
    """
    if torch.get_num_threads() != threads:
        TorchSettingsGuard.original(threads)


def check_engine(engine) -> None:
    """Refuse an engine whose core runs in another process or whose model is compiled (hooks cannot fire)."""
    from vllm.v1.engine.core_client import InprocClient
    if not isinstance(engine.engine_core, InprocClient):
        raise HooksUnavailableError(
            "vLLM's engine core runs in another process (VLLM_ENABLE_V1_MULTIPROCESSING was already read as 1 "
            "before ai.VLLM could set it): set VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating any engine")
    cc = engine.vllm_config.compilation_config
    mode = getattr(cc, "mode", getattr(cc, "level", 0))
    if mode not in (None, 0) and str(mode).split(".")[-1].upper() != "NONE":
        raise HooksUnavailableError(f"the engine compiles the model (compilation mode {mode}). {COMPILE_HINT}.")


def skeleton(entries):
    """A tree of empty modules with vLLM's names and class names (the driver's mirror under TP)."""
    classes = {}

    def make(cls_name):
        cls = classes.get(cls_name)
        if cls is None:
            cls = classes[cls_name] = type(cls_name, (torch.nn.Module,), {
                "__module__": "asyncinterp.models.vllm.skeleton",
                "__doc__": "placeholder: the real module lives in vLLM's tensor-parallel workers"})
        return cls()

    by_path = {}
    root = None
    for path, cls_name in entries:
        mod = make(cls_name)
        if path == "":
            root = mod
        else:
            parent, _, name = path.rpartition(".")
            by_path[parent].add_module(name, mod)
        by_path[path] = mod
    return root


def shutdown_engine(llm) -> None:
    """Shut a ``vllm.LLM``'s engine core down (best effort: it may be half made)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass
