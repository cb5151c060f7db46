"""The side of a vLLM run that lives with the model: envoys, the per-step layout, the kernel's host.

Interventions run where the model's modules are: in this process for
``tensor_parallel_size=1`` (the engine core runs in process), and in every
worker process under tensor parallelism, where vLLM's ``collective_rpc``
delivers them (cloudpickled) to each rank. Every rank then runs the same
coroutines on the same values (replicated values are equal on all ranks and
sharded ones are gathered, see :mod:`.tp`), so every rank makes the same
edits and vLLM's ranks stay in step. The return values of rank 0 go back to
the driver.

A run on the worker side (:class:`WorkerRun`) spans the engine steps of one
job of the live engine loop (see :mod:`.loop`); several runs are open at once,
each over its own requests, each keyed by the job's key:

* ``open`` (one RPC between two steps, before the run's first step) makes the
  run's job from what the driver sent (each invoke's request and
  interventions, and the job's options), spawns the tasks and lets them run
  to their first await, which installs hooks lazily;
* a pre-hook on the top-level model marks each engine step: it re-reads the
  runner's request order and query offsets into the :class:`FlatLayout`,
  ends the invokes whose request has finished (``Kernel.end_group``: their
  step loops end, code after them runs) and starts a kernel step in which
  only the invokes with tokens scheduled take part (``begin_step(active)``);
* ``close`` (one RPC after the step that finished its last request) finishes
  the kernel, removes its hooks and returns each task's outcome.

A stop request (``m.stop()``) or a failure does not unwind vLLM's forward
(that would corrupt the engine's state and fail every other request); the run
is *halted* instead: its hooks deliver nothing any more, and the driver aborts
its requests after the step. The driver learns about it by polling the open
runs after each step (:func:`rpc_poll`; a direct call in process), which also
carries the values that interventions :func:`emit` meanwhile under tensor
parallelism.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import torch

from ...hooks.envoy import Envoy, HookPoint
from ...hooks.modules import submodules
from ...invoke import Invoke
from ...job import InvokeSpec, Job, frozen_mapping
from ...kernel.errors import NotInRunError, ReplacementError
from ...kernel.scheduler import current_kernel, current_task
from ...model import Model
from ...run import EVENTS, Run, StopForward
from ..generating import Generated, generation_point
from .archs import arch_of
from .layout import FlatLayout, replace_fields
from .archs import backend_refusal
from .points import FirstLayerEnvoy, LayerEnvoy, UncheckedLayerEnvoy
from .semantic import AttentionEnvoy, is_attention_block, vllm_semantic_point
from .tp import sharding_for

# ----------------------------------------------------------------------------- hook points


def _no_gradients(what):
    from ...hooks.semantic import PointUnavailableError
    return PointUnavailableError(
        f"{what} is not available on vLLM: the engine runs under torch.inference_mode, so no autograd graph is "
        "recorded. Load the same weights with ai.LanguageModel.from_pretrained(path) for gradients; the semantic "
        "points (resid_pre/mid/post, mlp.pre/post, logits) read the same values there")


class NamedPoint(HookPoint):
    """A module hook point shown under a short name (``logits``, ``tokens``), with its place in the step."""

    __slots__ = ("label", "rank")

    def __init__(self, envoy, name, label, rank, base=None, read=None, write=None):
        HookPoint.__init__(self, envoy, name, base, read, write)
        self.label = label
        self.rank = rank

    def describe(self) -> str:
        return self.label


def _sampled_ids(out):
    ids = getattr(out, "sampled_token_ids", out)
    if isinstance(ids, torch.Tensor) and ids.dim() == 2:
        return ids[:, 0]
    return ids


def _with_sampled_ids(new, out):
    old = out.sampled_token_ids
    if isinstance(new, int):
        new = torch.full((old.shape[0],), new)
    if not isinstance(new, torch.Tensor) or new.numel() != old.shape[0]:
        raise ReplacementError(
            f"replacement for tokens must be a tensor of {old.shape[0]} token id(s) (one per request row), "
            f"got {new!r}")
    ids = old.clone()
    ids[:, 0] = new.reshape(-1).to(dtype=old.dtype, device=old.device)
    return replace_fields(out, {"sampled_token_ids": ids, **{
        k: getattr(out, k) for k in out.__dataclass_fields__ if k != "sampled_token_ids"}})


class _Sampler(torch.nn.Module):
    """Stand-in for the sampler in a driver-side skeleton (tensor parallel: the real one lives in the workers)."""


@dataclass
class RequestStep:
    """Where an invoke's request stands in the current engine step (``m.request`` inside a task)."""

    step: int                 # the kernel (engine) step
    positions: range          # positions of this request's tokens in this step
    prompt_len: int           # tokens in the prompt
    computed: int             # tokens already in the KV cache before this step
    prefill: bool             # this step processes prompt tokens
    samples: bool             # the token sampled at this step is kept (False mid-way through a chunked prompt)
    generated: int            # tokens generated before this step


class VLLMRoot(Model):
    """The root envoy of a vLLM model: vLLM's own module tree plus ``m.logits`` and ``m.tokens``."""

    logits = generation_point("the [1, vocab] next-token logits of this request at each step (output of the model's "
                    "logits_processor); edit in place or assign to change what is sampled")
    tokens = generation_point("the [1] token id sampled for this request at each step (sampler output); assign "
                    "(m.tokens = t) or edit in place to emit a different token, which is also what the next "
                    "step is fed")

    def __init__(self, module, sampler=None):
        Model.__init__(self, module)
        init = object.__setattr__
        init(self, "layer_ids", frozenset(id(m) for m in find_layers(module)))  #: ids of the decoder layers
        sampler = sampler if sampler is not None else _Sampler()
        lp = submodules(module).get("logits_processor")
        sampler_envoy = Envoy(sampler, "sampler", root=self)
        init(self, "_sampler_envoy", sampler_envoy)
        extra = {"tokens": NamedPoint(sampler_envoy, "tokens", "tokens", 2, sampler_envoy.output,
                                      _sampled_ids, _with_sampled_ids)}
        if lp is not None:
            extra["logits"] = NamedPoint(self._child("logits_processor"), "output", "logits", 1)
        init(self, "generation_points", extra)  #: the model-level points by name (``tokens``, ``logits``)

    def backward(self, tensors, **kwargs):
        """Not on vLLM: raises at once (the engine runs under ``torch.inference_mode``, no graph is recorded)."""
        raise _no_gradients("m.backward(...)")

    def standard_name(self, name: str):
        found = Model.standard_name(self, name)
        if found is None and name == "layers":      # a layer list the standard names do not know (see find_layers)
            for path in _LAYER_PATHS:
                envoy = self
                for part in path.split("."):
                    envoy = envoy.child(part) if envoy is not None and part in submodules(envoy.module) else None
                if envoy is not None:
                    return envoy
        return found

    def build_semantic_point(self, envoy, name):
        """vLLM's module tree: resid_pre/mid/post fold the (x, residual) pairs, attn.q/k/v/pattern, mlp.pre/post."""
        return vllm_semantic_point(self, envoy, name)

    def envoy_class_for(self, module):
        if id(module) in self.layer_ids:
            arch = arch_of(self.module)
            if arch is None:
                return UncheckedLayerEnvoy
            return FirstLayerEnvoy if arch.stream == "first" else LayerEnvoy
        if is_attention_block(module):
            return AttentionEnvoy
        return Model.envoy_class_for(self, module)

    @property
    def sampler(self) -> Envoy:
        """The engine's sampler (``m.sampler.output`` is vLLM's ``SamplerOutput``; ``m.tokens`` is easier)."""
        return self._sampler_envoy

    # ------------------------------------------------------ inside a run only
    def _worker_run(self, what):
        kernel = current_kernel()
        task = current_task()
        if kernel is None or task is None or not isinstance(kernel.host, WorkerRun) or kernel.host.model is not self:
            raise NotInRunError(f"m.{what} is only available inside an intervention of a vLLM run")
        return kernel.host, task

    @property
    def generated(self) -> Generated:
        """Inside a task: what this invoke's request has generated before the current step."""
        run, task = self._worker_run("generated")
        return run.generated(task.group)

    @property
    def request(self) -> RequestStep:
        """Inside a task: where this invoke's request stands in the current engine step."""
        run, task = self._worker_run("request")
        return run.request_step(task.group)

    def logits_of(self, hidden):
        """Logit lens: the final norm and the LM head applied to ``hidden`` (``[..., H]``), no hook point fired."""
        module = self.module
        norm = module.model.norm if hasattr(module, "model") and hasattr(module.model, "norm") else None
        flat = hidden.reshape(-1, hidden.shape[-1])

        def compute():
            h = norm(flat) if norm is not None else flat
            if isinstance(h, tuple):
                h = h[0]
            return module.compute_logits(h)
        kernel = current_kernel()
        out = kernel.host.call_adhoc(compute, (), {}) if kernel is not None else compute()
        return out.reshape(*hidden.shape[:-1], out.shape[-1])


#: where vLLM models keep their decoder layers ("model.h": GPT-BigCode under vLLM's Transformers backend)
_LAYER_PATHS = ("model.layers", "transformer.h", "model.decoder.layers", "layers", "model.h")


def find_layers(module) -> list:
    """The decoder layers of a vLLM model (``model.layers`` and the like), or ``[]``."""
    for path in _LAYER_PATHS:
        m = module
        for part in path.split("."):
            m = submodules(m).get(part) if m is not None else None
        if m is not None:
            return list(submodules(m).values())
    return []


# ----------------------------------------------------------------------------- the run


class Outcome:
    """What became of one task, sent back to the driver, where ``VLLMInvoke.value`` reads it (picklable)."""

    __slots__ = ("name", "done", "closed", "result", "exc")

    def __init__(self, name, done, closed, result, exc):
        self.name = name
        self.done = done
        self.closed = closed
        self.result = result
        self.exc = exc


class WorkerRun(Run):
    """A run on the model's side, spanning the engine steps of one ``trace``/``generate``.

    ``job``: the job as the worker knows it (:func:`worker_job`); ``requests``: per invoke, the
    engine's id of its request, or ``None`` for an invoke that sees every request of the job.
    """

    def __init__(self, session, job, requests):
        Run.__init__(self, session.root, job, FlatLayout())
        self.session = session
        self.runner = session.runner
        self.request_layout = FlatLayout(per_request=True)
        self.req_groups = {}      # internal request id -> invoke group
        self.group_reqs = {}
        self.whole = set()        # invoke groups without a request (see every request)
        for index, rid in enumerate(requests):
            if rid is None:
                self.whole.add(index)
            else:
                self.req_groups[rid] = index
                self.group_reqs[index] = rid
        self.started = set()      # request ids seen by the runner
        self.left = set()         # invoke groups whose request has finished
        self.halted = False
        self.nsteps = 0
        self.recorder = None
        model = self.runner.model
        self._ranked = {}
        lp = getattr(model, "logits_processor", None)
        if lp is not None:
            self._ranked[lp] = 1
        self._ranked[self.runner.sampler] = 2

    # ----------------------------------------------------------------- opening
    def open(self) -> None:
        """Install the per-step hook and start the tasks (they run to their first await)."""
        model = self.runner.model
        self.stepping = True
        self.on_cleanup(model.register_forward_pre_hook(self._on_forward, with_kwargs=True))
        self.keep_alive(model)
        root = self.model
        if root.needs_order_recording() and not any(r.recorder for r in self.session.runs.values()):
            self.recorder = root.start_order_recording()
        try:
            self.start()
        except StopForward:
            self.halt()
        except BaseException:
            self._stop_recording()
            self.cleanup()
            raise

    # ------------------------------------------------------------- every step
    def _on_forward(self, module, args, kwargs):
        if self.in_adhoc_call or self.halted:
            return None
        runner = self.runner
        kernel = self.kernel
        batch = runner.input_batch
        n = batch.num_reqs
        req_ids = batch.req_ids
        qsl = runner.query_start_loc.np
        if self.started:
            requests = runner.requests
            gone = [rid for rid in self.started if rid not in requests]
            for rid in gone:
                self.started.discard(rid)
                group = self.req_groups[rid]
                self.left.add(group)
                self.end_invoke(group)
        spans = {}
        groups = self.req_groups
        for i in range(n):
            rid = req_ids[i]
            g = groups.get(rid)
            if g is not None:
                spans[g] = (int(qsl[i]), int(qsl[i + 1]), i)
                self.started.add(rid)
        tokens = int(qsl[n]) if n else 0
        self.layout.set_step(spans, tokens, n)
        self.request_layout.set_step(spans, tokens, n)
        active = None if len(spans) == len(groups) else frozenset(spans).union(self.whole)
        if self.nsteps == 0:
            kernel.set_active(active)
        else:
            kernel.begin_step(active)
        self.nsteps += 1
        if kernel.interrupted:
            self.halt()
        return None

    def halt(self) -> None:
        """Stop delivering anything (a stop or a failure; vLLM's forward is not unwound); tell the driver."""
        self.halted = True
        self.stopped = True

    # ------------------------------------------------------------------ hooks
    def install_point(self, point) -> None:
        refusal = self.session.backend_refusal
        if refusal is not None and point.envoy.module not in self._ranked:
            from ...hooks.semantic import PointUnavailableError
            raise PointUnavailableError(f"{point.describe()} is not available: {refusal}")
        Run.install_point(self, point)

    def output_hook(self, point):
        return self._wrap(point, Run.output_hook(self, point), "output")

    def input_hook(self, point):
        return self._wrap(point, Run.input_hook(self, point), "inputs")

    def _wrap(self, point, inner, kind):
        envoy = point.envoy
        module = envoy.module
        per_request = module in self._ranked
        shard = None
        if self.session.tp > 1:
            parent = envoy.parent.module if envoy.parent is not None else None
            shard = sharding_for(module, kind, parent)
        run = self

        if kind == "output":
            def hook(mod, args, output):
                if run.halted or run.in_adhoc_call:
                    return None
                if per_request:
                    saved, run.layout = run.layout, run.request_layout
                try:
                    value, token = shard.gather(output) if shard is not None else (output, None)
                    try:
                        result = inner(mod, args, value)
                    except StopForward:
                        run.halt()
                        result = None
                    if shard is not None:   # the one re-sharding of every engine (hooks.sharded)
                        return shard.scatter(value, token, result, output)
                    return result
                finally:
                    if per_request:
                        run.layout = saved
            return hook

        def pre_hook(mod, args, kwargs):
            if run.halted or run.in_adhoc_call:
                return None
            if shard is not None:
                (full_args, full_kwargs), token = shard.gather((args, kwargs))
            else:
                full_args, full_kwargs = args, kwargs
            try:
                result = inner(mod, full_args, full_kwargs)
            except StopForward:
                run.halt()
                result = None
            if shard is None:
                return result
            replaced = None if result is None else (tuple(result[0]), dict(result[1]))
            out = shard.scatter((full_args, full_kwargs), token, replaced, (args, kwargs))
            return None if out is None else (tuple(out[0]), dict(out[1]))
        return pre_hook

    def activate(self, trap, task) -> None:
        from ...hooks.grad import GradPoint
        if isinstance(trap, GradPoint):
            raise _no_gradients(f"`await {trap.describe()}`")
        Run.activate(self, trap, task)

    def already_ran(self, trap, current_point) -> bool:
        # within an engine step: every module of the model, then the logits, then the sampler
        mine, now = self._rank(trap), self._rank(current_point)
        if mine or now:
            return mine < now
        return Run.already_ran(self, trap, current_point)

    def _rank(self, trap):
        envoy = getattr(trap, "envoy", None)
        if envoy is None:
            return 0
        return self._ranked.get(envoy.module, 0)

    # ------------------------------------------------------------- task info
    def generated(self, group) -> Generated:
        rid = self.group_reqs.get(group)
        if rid is None:
            raise NotInRunError("m.generated needs an invoke with a prompt (this one sees the whole batch)")
        state = self.runner.requests.get(rid)
        ids = list(state.output_token_ids) if state is not None else []
        return Generated(torch.tensor(ids, dtype=torch.long), self.session.decode(ids))

    def request_step(self, group) -> RequestStep:
        rid = self.group_reqs.get(group)
        if rid is None:
            raise NotInRunError("m.request needs an invoke with a prompt (this one sees the whole batch)")
        state = self.runner.requests.get(rid)
        span = self.layout.spans.get(group)
        n = 0 if span is None else span[1] - span[0]
        computed = state.num_computed_tokens if state is not None else 0
        prompt = state.num_prompt_tokens if state is not None else 0
        return RequestStep(step=self.kernel.step, positions=range(computed, computed + n), prompt_len=prompt,
                           computed=computed, prefill=computed < prompt,
                           samples=computed + n >= prompt, generated=len(state.output_token_ids) if state else 0)

    # ----------------------------------------------------------------- closing
    def _stop_recording(self):
        rec = self.recorder
        if rec is not None:
            self.recorder = None
            rec.stop()
            self.model.finish_order_recording(rec)

    def close(self, cancelled: bool = False):
        """Finish the kernel (unless halted or cancelled), remove every hook; returns (outcomes, failures)."""
        kernel = self.kernel
        try:
            self._stop_recording()
            if kernel is not None and not cancelled and not self.halted:
                kernel.finish()
            elif kernel is not None and not cancelled and kernel.stop_requested and not kernel.failures:
                kernel.end_step_loops()   # m.stop(): step loops end cleanly, the code after them runs
        finally:
            self.cleanup()
        self.done = True
        outcomes = [[Outcome(t.name, t.done, t.closed, t.result, t.exc) for t in inv.tasks] for inv in self.invokes]
        failures = list(kernel.failures) if kernel is not None else []
        return outcomes, failures


# ----------------------------------------------------------------------------- per worker state and RPCs


class WorkerSession:
    """Per worker (or in process): the root envoy over the real model and the open runs, by job key."""

    def __init__(self, worker, root=None, model_dir=None, tokenizer=None):
        runner = worker.model_runner
        self.runner = runner
        self.model_dir = model_dir
        self._tokenizer = tokenizer
        try:
            from vllm.distributed import get_tensor_model_parallel_world_size
            self.tp = get_tensor_model_parallel_world_size()
        except Exception:  # noqa: BLE001
            self.tp = 1
        self.rank = int(getattr(worker, "rank", 0) or 0)
        if root is None:
            root = VLLMRoot(runner.model, runner.sampler)
        self.root = root
        self.runs = {}            # job key -> open WorkerRun
        self.backend_refusal = backend_refusal(runner.model)   # module points refused on the Transformers backend

    def decode(self, ids):
        tok = self._tokenizer
        if tok is None and self.model_dir is not None:
            try:
                from transformers import AutoTokenizer
                tok = self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            except Exception:  # noqa: BLE001 - text is a convenience
                return None
        return None if tok is None else tok.decode(ids, skip_special_tokens=True)

    def open(self, key, options, invokes) -> "WorkerRun":
        """Open run ``key`` (see :func:`rpc_open`) and start its tasks."""
        if key in self.runs:
            raise RuntimeError(f"a run with key {key!r} is already open on this worker")
        run = WorkerRun(self, worker_job(options, invokes["invokes"]), list(invokes["requests"]))
        run.context.setdefault(EVENTS, [])
        self.runs[key] = run
        try:
            run.open()
        except BaseException:
            self.runs.pop(key, None)
            raise
        return run

    def status(self, key):
        """``(halted, steps, stopped invokes, events)`` of an open run; its events are handed over once."""
        run = self.runs.get(key)
        if run is None:
            return None
        events = run.context.get(EVENTS)
        taken = list(events) if events else []
        if events:
            events.clear()
        return run.halted, run.nsteps, sorted(run.stopped_invokes), taken

    def cancel(self, key, groups) -> None:
        """Close the tasks of these invoke groups of run ``key`` at its next hook point (their requests were aborted)."""
        run = self.runs.get(key)
        if run is not None and run.kernel is not None:
            for g in groups:
                run.kernel.cancel_group(g)

    def close(self):
        for run in list(self.runs.values()):
            if not run.done:
                run.close(cancelled=True)
        self.runs.clear()


def skeleton_of(module) -> list:
    """``[(path, class name), ...]`` of a module tree (to mirror it on the driver under tensor parallelism)."""
    return [(name, type(m).__name__) for name, m in module.named_modules()]


def rpc_init(worker, options: dict):
    """Attach a :class:`WorkerSession` to ``worker``; returns the module skeleton when asked."""
    old = getattr(worker, "asyncinterp_session", None)
    if old is not None:
        old.close()
    session = WorkerSession(worker, **{k: v for k, v in options.items() if k != "skeleton"})
    worker.asyncinterp_session = session
    if options.get("skeleton") and session.rank == 0:
        return skeleton_of(session.runner.model)
    return None


def _load(payload):
    if isinstance(payload, (bytes, bytearray)):
        import cloudpickle
        return cloudpickle.loads(payload)
    return payload


def rpc_open(worker, key, options: dict, payload):
    """Open run ``key``: ``payload`` is ``{"requests": [request id or None, ...], "invokes": (InvokeSpec, ...)}``
    in invoke order, the job's own invoke specs without their prompts (cloudpickled bytes under TP).

    ``options``: the job's ``kind``, ``on_error`` and ``stop_per_invoke``, and in process its ``context`` (which
    holds e.g. the serving batcher's request table that ``serve.emit`` looks up).
    """
    worker.asyncinterp_session.open(key, options, _load(payload))
    return None


def worker_job(options: dict, specs) -> Job:
    """The job of a worker run: the driver's invoke specs (no inputs: the engine has the prompts)."""
    specs = tuple(specs)
    return Job(specs, options.get("kind", "generate"), options.get("on_error", "stop"),
               bool(options.get("stop_per_invoke")), context=frozen_mapping(options.get("context")),
               results=tuple(Invoke(i, spec) for i, spec in enumerate(specs)))


def rpc_poll(worker, keys):
    """Rank 0: ``{key: (halted, steps, stopped invokes, events)}`` for the open runs among ``keys``."""
    session = worker.asyncinterp_session
    if session.rank != 0:
        return None
    return {key: session.status(key) for key in keys}


def rpc_cancel(worker, key, groups):
    """Close the tasks of these invoke groups of run ``key`` at the next hook point (their requests were aborted)."""
    worker.asyncinterp_session.cancel(key, groups)
    return None


def rpc_close(worker, key, cancelled: bool = False, portable: bool = False):
    """End run ``key``; rank 0 returns ``(outcomes, failures)`` (made picklable when ``portable``)."""
    session = worker.asyncinterp_session
    run = session.runs.pop(key, None)
    if run is None:
        return None
    outcomes, failures = run.close(cancelled=cancelled)
    if session.rank != 0:
        return None
    if portable:
        outcomes = [[_portable_outcome(o) for o in inv] for inv in outcomes]
        failures = [_portable_exc(e) for e in failures]
    return outcomes, failures


def rpc_shutdown(worker):
    session = getattr(worker, "asyncinterp_session", None)
    if session is not None:
        session.close()
        worker.asyncinterp_session = None
    return None


def _compact(value):
    """Tensors copied out of the engine's buffers (a view would pickle its whole storage)."""
    from ...hooks.views import map_tensors
    return map_tensors(lambda t: t.detach().clone(), value)


def _portable_exc(exc):
    import pickle
    if exc is None:
        return None
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        exc.add_note(f"(raised in the vLLM worker process, rank 0)\n{text}")
    except Exception:  # noqa: BLE001
        pass
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - an exception type that cannot cross processes
        err = RuntimeError(f"{type(exc).__name__}: {exc}")
        err.add_note(f"(raised in the vLLM worker process, rank 0)\n{text}")
        return err


def _portable_outcome(o: Outcome) -> Outcome:
    import pickle
    result = _compact(o.result)
    try:
        pickle.dumps(result)
    except Exception as err:  # noqa: BLE001
        return Outcome(o.name, True, False, None, TypeError(
            f"the result of intervention {o.name!r} cannot be sent back from the vLLM worker process "
            f"(tensor parallel): {err}. Return tensors, numbers, strings, lists or dicts of them"))
    return Outcome(o.name, o.done, o.closed, result, _portable_exc(o.exc))
