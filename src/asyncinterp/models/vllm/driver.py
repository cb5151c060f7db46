"""``ai.VLLM``: interventions inside a real vLLM engine (in process), one vLLM request per invoke.

    import asyncinterp as ai
    model = ai.VLLM("path/to/model", dtype="float32")          # vllm.LLM(..., enforce_eager=True)

    async def steer(m):
        async for _ in m.steps():                               # one iteration per engine step
            h = await m.model.layers[3].hidden                  # residual stream, [1, n, hidden]
            h[:, -1] += 4.0 * direction

    gen = model.generate("Once upon a time", steer, max_new_tokens=20)
    print(gen.text, gen.tokens, gen.result)

    with model.generate(max_new_tokens=10) as run:              # several requests, continuous batching
        a = run.invoke("The capital of France is", read_logits)
        b = run.invoke("Hello", steer, temperature=0.8, seed=1)  # its own sampling parameters

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
back from rank 0. The driver (this module) adds the requests, steps the
engine, aborts requests when a task stops the run, and collects tokens.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Mapping

import torch

from ...kernel.errors import RunCancelled
from ...kernel.task import is_async_fn
from ...model import Trace
from ...run import check_intervention
from ..generating import Generated, GeneratedInvoke, GeneratingModel
from .loop import EngineClosed, EngineLoop
from .worker import (
    Outcome,
    VLLMRoot,
    rpc_cancel,
    rpc_close,
    rpc_init,
    rpc_open,
    rpc_poll,
    rpc_shutdown,
)

__all__ = ["VLLM", "VLLMInvoke", "VLLMRun", "HooksUnavailableError", "EngineClosed"]

log = logging.getLogger("asyncinterp.vllm")
_loop_lock = threading.Lock()


class _TorchSettingsGuard:
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


class HooksUnavailableError(RuntimeError):
    """The engine's settings make module hooks impossible (compiled model, engine core in another process)."""


# ----------------------------------------------------------------------------- engine set-up

_COMPILE_HINT = (
    "asyncinterp reaches vLLM's layers through PyTorch module hooks, which only fire when the model runs "
    "eagerly: keep enforce_eager=True (the default of ai.VLLM) and do not pass a compilation_config that "
    "compiles the model (torch.compile / CUDA graphs bypass the hooks)")


def _check_engine_kwargs(kw: dict) -> dict:
    kw = dict(kw)
    if kw.get("enforce_eager") is False:
        raise HooksUnavailableError(f"enforce_eager=False was given. {_COMPILE_HINT}.")
    kw["enforce_eager"] = True
    cc = kw.get("compilation_config")
    if cc is not None:
        level = cc if isinstance(cc, int) else (cc.get("mode", cc.get("level")) if isinstance(cc, dict)
                                                 else getattr(cc, "mode", None))
        if level not in (None, 0) and str(level).split(".")[-1].upper() not in ("NONE", "0"):
            raise HooksUnavailableError(f"compilation_config={cc!r} compiles the model. {_COMPILE_HINT}.")
    if kw.get("speculative_config"):
        raise HooksUnavailableError("speculative decoding is not supported: it changes the per-step token "
                                    "layout the per-request views rely on")
    if int(kw.get("pipeline_parallel_size", 1) or 1) > 1:
        raise NotImplementedError("pipeline parallelism is not supported (tensor parallelism is)")
    if int(kw.get("data_parallel_size", 1) or 1) > 1:
        raise NotImplementedError("data parallelism is not supported (tensor parallelism is)")
    return kw


def _prepare_environment(tp: int) -> None:
    value = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    if value not in (None, "0"):
        raise HooksUnavailableError(
            f"VLLM_ENABLE_V1_MULTIPROCESSING={value} runs vLLM's engine core in another process, out of reach "
            "of asyncinterp's hooks; unset it or set it to 0 (ai.VLLM sets 0 when it is unset)")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ and not torch.cuda.is_available():
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
        if len(cores) >= tp:
            per = len(cores) // tp
            chunks = [cores[i * per:(i + 1) * per] for i in range(tp)]
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                f"{c[0]}-{c[-1]}" if len(c) > 1 else str(c[0]) for c in chunks)


def _skeleton(entries):
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


# ----------------------------------------------------------------------------- runs


class VLLMInvoke(GeneratedInvoke):
    """One vLLM request and its interventions: ``.result``, ``.tokens``, ``.text`` after the run."""

    repr_name = "VLLMInvoke"

    def __init__(self, run, index, input, fns, kwargs=None):
        GeneratedInvoke.__init__(self, run, index, input, fns, kwargs)
        self.prompt_ids = None
        self.params = None
        self.request_id = None       # our (external) vLLM request id
        self.token_ids = []
        self.text_pieces = []        # vLLM's detokenized text, one piece per engine step
        self.finish_reason = None
        self.logprobs = []           # with logprobs=k: per generated token, {token id: log-probability}
        self.cached_tokens = None    # prompt tokens vLLM took from its prefix cache (0 for intervened requests)

    def cancel(self) -> None:
        """Thread-safe: abort this invoke's request and close its interventions; the others go on."""
        self.cancelled = True
        self.run.cancel_invoke(self.index)

    def add_output(self, completion, finished: bool) -> None:
        """Record one engine step's output for this request (a vLLM ``CompletionOutput``, delta mode)."""
        self.token_ids.extend(completion.token_ids)
        self.text_pieces.append(completion.text)
        if completion.logprobs:
            self.logprobs.extend({int(t): float(lp.logprob) for t, lp in entry.items()}
                                 for entry in completion.logprobs)
        if finished:
            self.finish_reason = completion.finish_reason

    def generated_so_far(self) -> Generated:
        return Generated(torch.tensor(self.token_ids, dtype=torch.long), "".join(self.text_pieces))


class VLLMRun(Trace):
    """A trace (``max_new_tokens=1``) or generation on a :class:`VLLM` model: one request per invoke.

    Running it submits it to the engine's live loop (:mod:`.loop`) as a job:
    it joins the engine between two steps, beside whatever else runs there,
    and is done when its own requests finish. ``listener`` (serving): an
    object whose ``on_output(invoke)``, ``on_event(index, item)`` and
    ``on_finish(run)`` the loop thread calls as the run's requests produce
    tokens, its interventions emit values, and when it is done.
    """

    def __init__(self, model, max_new_tokens: int | None = 1, sampling: dict | None = None,
                 on_error: str = "stop"):
        Trace.__init__(self, model, on_error=on_error)
        self.max_new_tokens = max_new_tokens
        self.sampling = dict(sampling or {})
        self.listener = None
        self.key = None               # the job key (the loop sets it)
        self.pending = set()          # ids of this run's requests still in the engine
        self.opened = False           # its worker run is open (it has interventions)
        self.halted = False
        self.error = None             # what ended the run from outside its interventions (admission, engine)
        self.aborted = False          # its requests were aborted because the run was cancelled
        self.finished_event = threading.Event()
        self._by_id = {}
        self.failures = []
        self._cancels = []
        self._stop_seen = set()
        self._stepped = False

    # ------------------------------------------------------------------ building (caller thread)
    def cancel_invoke(self, index) -> None:
        """Thread-safe: abort invoke ``index``'s request before the next step and close its interventions."""
        self._cancels.append(index)
        self._wake()

    def invoke(self, input=None, *fns, sampling_params=None, **sampling) -> VLLMInvoke:
        """Add a prompt (``None``: an invoke that sees every request of this run) and its interventions.

        ``sampling_params`` (a ``vllm.SamplingParams``) or keywords
        (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``,
        ``do_sample``, any ``SamplingParams`` field) set this request's own
        sampling; the rest come from the run (greedy by default).
        """
        if callable(input) and not fns and not isinstance(input, torch.Tensor) and is_async_fn(input):
            input, fns = None, (input,)
        for fn in fns:
            check_intervention(fn)
        inv = VLLMInvoke(self, len(self.invokes), input, fns)
        if input is None and (sampling or sampling_params is not None):
            raise TypeError("an invoke without a prompt has no request, so it takes no sampling parameters")
        if input is not None:
            inv.prompt_ids = _prompt_ids(input, self.model.tokenizer)
            check = self.model.max_model_len
            if check is not None and len(inv.prompt_ids) >= check:
                raise ValueError(f"a prompt of {len(inv.prompt_ids)} tokens does not fit the engine's max_model_len "
                                 f"of {check} (it needs room for at least one new token)")
            inv.params = self._params(sampling_params, sampling)
        self.invokes.append(inv)
        return inv

    def _params(self, given, overrides):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind
        if given is not None:
            if overrides:
                raise TypeError("give either sampling_params=SamplingParams(...) or sampling keywords, not both")
            params = given.clone()
        else:
            kw = dict(self.sampling)
            kw.update(overrides)
            params = SamplingParams(**_sampling_kwargs(kw, self.max_new_tokens))
        if getattr(params, "n", 1) != 1:
            raise ValueError("n > 1 is not supported: one invoke is one request (use several invokes)")
        params.output_kind = RequestOutputKind.DELTA
        return params

    def cancel(self) -> None:
        """Thread-safe: abort the requests before the next engine step; the run raises ``RunCancelled``."""
        self.cancelled = True
        self._wake()

    def _wake(self):
        loop = self.model.loop
        if loop is not None:
            loop.wake()

    @property
    def intervened(self) -> bool:
        """Some invoke has interventions (its requests then get their own KV blocks, see :meth:`admit`)."""
        return any(inv.fns for inv in self.invokes)

    # ------------------------------------------------------------------ running (caller thread)
    def drive(self) -> None:
        """Submit the run to the engine loop and wait until its requests have finished."""
        if not any(inv.input is not None for inv in self.invokes):
            raise ValueError("no invoke has a prompt: give at least one invoke a prompt to run the model on")
        loop = self.model.live_loop()
        if loop.in_loop_thread():
            raise RuntimeError("a vLLM run cannot start another run of the same engine from inside an intervention "
                               "(it would wait for the step the intervention is part of)")
        loop.submit(self)
        while not self.finished_event.wait(1.0):
            pass
        self.raise_outcome()

    def raise_outcome(self) -> None:
        """After the run: raise what ended it (engine error, cancellation) or its failures (``on_error="stop"``)."""
        if self.error is not None:
            raise self.error
        if self.aborted and self.cancelled:
            raise RunCancelled("the run was cancelled; its requests were aborted before the next engine step and "
                               "its hooks removed (the engine went on with the other requests)")
        failures = self.failures
        if failures and self.on_error == "stop":
            self._raise(failures)

    # ------------------------------------------------------------------ in the engine loop's thread
    def admit(self, loop) -> bool:
        """Add the requests and open the worker run. ``False``: the run failed and is already finished.

        Each request gets :meth:`cache_salt`'s salt (the prefix cache is shared only between equal salts).
        """
        model = self.model
        engine = loop.engine
        salted = self.intervened
        internal = {}
        try:
            for inv in self.invokes:
                if inv.input is None:
                    continue
                ext = f"{self.key}-{inv.index}"
                prompt = {"prompt_token_ids": list(inv.prompt_ids)}
                salt = self.cache_salt(inv)
                if salt is not None:
                    prompt["cache_salt"] = salt
                internal[inv.index] = engine.add_request(ext, prompt, inv.params)
                inv.request_id = ext
                self._by_id[ext] = inv
                self.pending.add(ext)
            if salted:
                payload = [(internal.get(inv.index), inv.fns) for inv in self.invokes]
                if model.tp > 1:
                    payload = _dumps(payload)
                    extras = {"stop_per_invoke": self.stop_per_invoke}
                else:
                    extras = {"context": self.context, "stop_per_invoke": self.stop_per_invoke}
                self.opened = True
                model.rpc(rpc_open, self.key, self.on_error, payload, extras)
                # a task may have failed or stopped before the first step: then no step is needed
                self.after_step(engine, (), model.poll([self.key]).get(self.key), False)
        except BaseException as exc:  # noqa: BLE001 - this run fails alone
            self.fail(exc)
            self.close()
            return False
        return True

    def cache_salt(self, inv) -> str | None:
        """The ``cache_salt`` of ``inv``'s vLLM request: vLLM shares KV blocks only between equal salts.

        A run with interventions gives each of its requests a salt of its own, whatever its input asked
        for: its blocks are neither read from vLLM's prefix cache (so it sees, and can edit, every prompt
        position) nor reused by any other request (so its edits cannot leak into another request's
        outputs). A plain request shares the cache: with everybody (no salt), or, when its input is a
        mapping with a ``cache_salt`` (as vLLM's prompts take), with the requests that give the same salt.
        Those salts are namespaced (``user-...``) so that no input can name one of ours (``asyncinterp-...``).
        """
        if self.intervened:
            return f"asyncinterp-{os.getpid()}-{self.key}-{inv.index}"
        salt = inv.input.get("cache_salt") if isinstance(inv.input, Mapping) else None
        return None if salt is None else f"user-{salt}"

    def before_step(self, engine) -> None:
        """Apply cancellations: the run's (or some invokes') requests leave the engine now."""
        if self.cancelled and self.pending:
            _abort(engine, list(self.pending))
            self.pending.clear()
            self.aborted = True
            return
        if self._cancels:
            groups = set()
            while self._cancels:
                groups.add(self._cancels.pop())
            self._abort_invokes(engine, groups)
            if self.opened:
                self.model.cancel_groups(self.key, sorted(groups))

    def after_step(self, engine, outs, status, idle: bool) -> None:
        """Take this step's outputs of the run's requests and what its worker run reports."""
        halted = False
        ended = ()
        listener = self.listener
        if status is not None:
            halted, steps, stopped, events = status
            if outs and not self._stepped and not halted and steps == 0:
                raise HooksUnavailableError(
                    f"the engine ran a step but asyncinterp's hooks on {type(self.model.module).__name__} did not "
                    f"fire. {_COMPILE_HINT}.")
            ended = set(stopped) - self._stop_seen
            self._stop_seen |= ended
            if events and listener is not None:
                for index, item in events:
                    listener.on_event(index, item)
        if outs:
            self._stepped = True
        for out in outs:
            inv = self._by_id[out.request_id]
            if inv.cached_tokens is None:
                inv.cached_tokens = getattr(out, "num_cached_tokens", None)
            if not halted and inv.index not in ended:
                for c in out.outputs[:1]:
                    inv.add_output(c, out.finished)
                if listener is not None:
                    listener.on_output(inv)
            if out.finished:
                self.pending.discard(out.request_id)
        if halted:
            self.halted = True
            if self.pending:
                _abort(engine, list(self.pending))
                self.pending.clear()
        elif ended:
            self._abort_invokes(engine, ended)
        if self.pending and idle:
            self.pending.clear()    # the engine has nothing left to run: they were dropped

    def _abort_invokes(self, engine, groups) -> None:
        """Abort the still-running requests of these invokes (in the engine alone)."""
        ids = [inv.request_id for inv in self.invokes if inv.index in groups and inv.request_id in self.pending]
        if ids:
            _abort(engine, ids)
            self.pending.difference_update(ids)

    def fail(self, exc) -> None:
        """Something outside the interventions failed (admission, the engine): abort, remember ``exc``."""
        if self.pending:
            try:
                _abort(self.model.engine, list(self.pending))
            except Exception:  # noqa: BLE001 - the engine may be broken; the run fails anyway
                pass
            self.pending.clear()
        if self.error is None:
            self.error = exc

    def fail_before_admission(self, exc) -> None:
        self.error = exc
        self.close()

    def finished_requests(self) -> bool:
        return not self.pending

    def close(self) -> None:
        """Close the worker run, record outcomes, wake the caller and the listener."""
        model = self.model
        outcomes = failures = None
        try:
            if self.opened:
                self.opened = False
                back = model.rpc(rpc_close, self.key, self.aborted or self.error is not None, model.tp > 1)
                if back is not None:
                    outcomes, failures = back
        except BaseException as exc:  # noqa: BLE001
            if self.error is None:
                self.error = exc
        finally:
            self.done = True
            self.stopped = self.halted
            self.output = [inv for inv in self.invokes if inv.input is not None]
            self.failures = list(failures or ())
            for inv, tasks in zip(self.invokes, outcomes or [[] for _ in self.invokes]):
                inv.tasks = tasks
            for inv in self.invokes:
                inv.done = True      # Invoke.result reads it (Run.finished is not called on this path)
            listener = self.listener
            self.finished_event.set()
            if listener is not None:
                try:
                    listener.on_finish(self)
                except Exception:  # noqa: BLE001 - a listener must not break the loop
                    log.exception("vLLM run listener failed")


class StreamListener:
    """Turns a live run's outputs into stream events in a :class:`~asyncinterp.aio.Mailbox` (``None`` ends it)."""

    def __init__(self, box, tokenizer):
        self.box = box
        self.tokenizer = tokenizer
        self.sent = {}

    def on_output(self, invoke) -> None:
        ids = invoke.token_ids
        i = self.sent.get(invoke.index, 0)
        while i < len(ids):
            before = self.tokenizer.decode(ids[:i], skip_special_tokens=True)
            now = self.tokenizer.decode(ids[:i + 1], skip_special_tokens=True)
            self.box.put({"event": "token", "step": i, "token": ids[i], "text": now[len(before):]})
            i += 1
        self.sent[invoke.index] = i

    def on_event(self, index, item) -> None:
        self.box.put(item)

    def on_finish(self, run) -> None:
        self.box.put(None)


def _abort(engine, ids):
    try:
        engine.abort_request(list(ids), internal=False)
    except TypeError:  # older signature
        engine.abort_request(list(ids))


def _prompt_ids(input, tokenizer) -> list:
    """One request's prompt as token ids: a string, token ids (list / 1-D tensor), or a mapping."""
    if isinstance(input, str):
        if not input:
            raise ValueError("empty prompt: a causal language model needs at least one token to predict from")
        ids = list(tokenizer(input)["input_ids"])
    elif isinstance(input, Mapping):
        key = "prompt_token_ids" if "prompt_token_ids" in input else "input_ids"
        if key not in input:
            raise ValueError(f"a mapping input needs 'prompt_token_ids' or 'input_ids', got keys {sorted(input)}")
        salt = input.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
        ids = input[key]
        if isinstance(ids, torch.Tensor):
            if ids.dim() == 2 and ids.shape[0] == 1:
                ids = ids[0]
            ids = ids.tolist()
        elif ids and isinstance(ids[0], (list, tuple)):
            if len(ids) != 1:
                raise ValueError("one vLLM invoke is one request: give one prompt (use one invoke per prompt)")
            ids = ids[0]
        ids = list(ids)
    elif isinstance(input, torch.Tensor):
        if input.dim() == 2 and input.shape[0] == 1:
            input = input[0]
        if input.dim() != 1 or input.dtype.is_floating_point:
            raise ValueError(f"token ids must be a 1-D integer tensor (one request), got shape {tuple(input.shape)}")
        ids = input.tolist()
    elif isinstance(input, (list, tuple)):
        if input and all(isinstance(x, str) for x in input):
            raise ValueError("one vLLM invoke is one request: give one prompt per invoke "
                             "(`for p in prompts: run.invoke(p, fn)`)")
        if input and isinstance(input[0], (list, tuple)):
            if len(input) != 1:
                raise ValueError("one vLLM invoke is one request: give one prompt per invoke")
            input = input[0]
        ids = list(input)
    else:
        raise TypeError(f"cannot use {type(input).__name__} as a vLLM prompt: give a string, token ids "
                        "(list of ints or 1-D tensor) or a dict with 'prompt_token_ids'")
    if not ids:
        raise ValueError("empty prompt: a causal language model needs at least one token to predict from")
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool):
            raise TypeError(f"token ids must be ints, got {t!r}")
    return ids


def _sampling_kwargs(kw: dict, max_new_tokens) -> dict:
    """transformers-style generation keywords -> ``SamplingParams`` keywords (greedy unless asked)."""
    kw = dict(kw)
    n = kw.pop("max_new_tokens", max_new_tokens)
    if "max_tokens" not in kw:
        kw["max_tokens"] = n
    if kw["max_tokens"] is not None and (not isinstance(kw["max_tokens"], int) or kw["max_tokens"] < 1):
        raise ValueError(f"max_new_tokens must be a positive int, got {kw['max_tokens']!r}")
    do_sample = kw.pop("do_sample", None)
    if do_sample is False:
        kw["temperature"] = 0.0
    elif do_sample is True:
        kw.setdefault("temperature", 1.0)
    else:
        kw.setdefault("temperature", 0.0)
    return kw


def _dumps(payload) -> bytes:
    """cloudpickle the invokes' interventions; user modules travel by value (the workers may not see edits)."""
    import cloudpickle
    modules = set()

    def collect(fn, depth=0):
        import functools
        if depth > 3:
            return
        while isinstance(fn, functools.partial):
            fn = fn.func
        name = getattr(fn, "__module__", None) or type(fn).__module__
        mod = sys.modules.get(name)
        path = getattr(mod, "__file__", None) or ""
        if mod is not None and name != "__main__" and name.split(".")[0] not in ("asyncinterp", "torch", "vllm") \
                and path and "site-packages" not in path and "dist-packages" not in path:
            modules.add(mod)
        for cell in getattr(fn, "__closure__", None) or ():  # e.g. the wrapper of a model.edit
            try:
                inner = cell.cell_contents
            except ValueError:
                continue
            if callable(inner) and hasattr(inner, "__module__"):
                collect(inner, depth + 1)

    for _, fns in payload:
        for fn in fns:
            collect(fn)
    registered = []
    for mod in modules:
        try:
            cloudpickle.register_pickle_by_value(mod)
            registered.append(mod)
        except ValueError:
            pass
    try:
        return cloudpickle.dumps(payload)
    finally:
        for mod in registered:
            cloudpickle.unregister_pickle_by_value(mod)


# ----------------------------------------------------------------------------- the model


class VLLM(GeneratingModel, VLLMRoot):
    """A vLLM engine (``vllm.LLM``, in process) whose runs take interventions.

    ``VLLM(model_dir, **engine_kwargs)``: ``engine_kwargs`` go to
    ``vllm.LLM`` (``dtype``, ``max_model_len``, ``kv_cache_memory_bytes``,
    ``tensor_parallel_size``, ``seed``, ...). ``enforce_eager`` is forced on
    (hooks do not fire in a compiled model) and the engine core runs in this
    process. The envoy tree mirrors vLLM's model: ``m.model.layers[i]``,
    ``.self_attn.qkv_proj``, ``.mlp.gate_up_proj``, ``m.logits_processor``,
    plus ``m.logits``, ``m.tokens`` and ``layers[i].hidden``.
    """

    def __init__(self, model_dir, tokenizer=None, **engine_kwargs):
        kw = _check_engine_kwargs(engine_kwargs)
        tp = int(kw.get("tensor_parallel_size", 1) or 1)
        _prepare_environment(tp)
        try:
            import vllm
        except ImportError as exc:
            raise ImportError(
                f"ai.VLLM needs vLLM ({exc}). On CPU install it beside the pinned torch with "
                "`bash scripts/install_vllm.sh .venv` (make setup does), which also removes vLLM's companion "
                "wheels that do not load with this torch") from exc
        _TorchSettingsGuard.opened()
        try:
            llm = vllm.LLM(model=str(model_dir), tokenizer=tokenizer, **kw) if tokenizer is not None \
                else vllm.LLM(model=str(model_dir), **kw)
        except BaseException:
            _TorchSettingsGuard.closed()
            raise
        engine = llm.llm_engine
        try:
            self._check_engine(engine)
            tok = llm.get_tokenizer()
            options = {"model_dir": str(model_dir)}
            local = None
            if tp == 1:
                runner = engine.model_executor.driver_worker.worker.model_runner
                VLLMRoot.__init__(self, runner.model, runner.sampler)
                options.update(root=self, tokenizer=tok)
                llm.collective_rpc(rpc_init, args=(options,))
                local = engine.model_executor.driver_worker.asyncinterp_session
            else:
                options.update(skeleton=True)
                skeleton = [s for s in llm.collective_rpc(rpc_init, args=(options,)) if s is not None][0]
                VLLMRoot.__init__(self, _skeleton(skeleton), None)
        except BaseException:
            _shutdown_engine(llm)
            _TorchSettingsGuard.closed()
            raise
        init = object.__setattr__
        init(self, "llm", llm)
        init(self, "engine", engine)
        init(self, "tokenizer", tok)
        init(self, "tp", tp)
        init(self, "model_dir", str(model_dir))
        init(self, "loop", None)                     #: the live engine loop (:mod:`.loop`), made on first use
        init(self, "local_session", local)           #: the WorkerSession in this process (TP=1), else None
        init(self, "closed", False)
        init(self, "max_model_len", getattr(engine.vllm_config.model_config, "max_model_len", None))

    @staticmethod
    def _check_engine(engine):
        from vllm.v1.engine.core_client import InprocClient
        if not isinstance(engine.engine_core, InprocClient):
            raise HooksUnavailableError(
                "vLLM's engine core runs in another process (VLLM_ENABLE_V1_MULTIPROCESSING was already read as 1 "
                "before ai.VLLM could set it): set VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating any engine")
        cc = engine.vllm_config.compilation_config
        mode = getattr(cc, "mode", getattr(cc, "level", 0))
        if mode not in (None, 0) and str(mode).split(".")[-1].upper() != "NONE":
            raise HooksUnavailableError(f"the engine compiles the model (compilation mode {mode}). {_COMPILE_HINT}.")

    # ------------------------------------------------------------------ plumbing
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
        """The engine's live loop (one per engine, started on first use)."""
        if self.closed:
            raise EngineClosed("this VLLM model was closed")
        loop = self.loop
        if loop is None:
            with _loop_lock:
                loop = self.loop
                if loop is None:
                    loop = EngineLoop(self)
                    object.__setattr__(self, "loop", loop)
        return loop

    def new_run(self, **options) -> VLLMRun:
        return VLLMRun(self, max_new_tokens=1, on_error=options.get("on_error", "stop"))

    def submit(self, run) -> None:
        """Start ``run`` without waiting: it joins the engine before its next step (serving).

        Its ``listener`` hears about its tokens, emitted values and end; ``run.finished_event`` is set
        when it is done (then :meth:`VLLMRun.raise_outcome` raises what failed).
        """
        if not any(inv.input is not None for inv in run.invokes):
            raise ValueError("no invoke has a prompt: give at least one invoke a prompt to run the model on")
        self._prepare(run)
        self.live_loop().submit(run)

    def execute(self, run) -> None:
        self._prepare(run)
        run.drive()

    def _prepare(self, run):
        if self.closed:
            raise EngineClosed("this VLLM model was closed")
        if self.edits:
            from ...tools.edit import apply_edits
            apply_edits(self, run)

    # ------------------------------------------------------------------ API
    def _generation(self, max_new_tokens, on_error, sampling) -> VLLMRun:
        return VLLMRun(self, max_new_tokens=max_new_tokens, sampling=sampling, on_error=on_error)

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
        run = self._generation(_checked_max_new_tokens(max_new_tokens), on_error, {})
        inv = run.invoke(input, *fns, **sampling)
        box = Mailbox()
        run.listener = StreamListener(box, self.tokenizer)
        self.submit(run)
        try:
            while True:
                item = await box.get()
                if item is None:
                    break
                yield item
        finally:
            if not run.done:
                run.cancel()
        run.raise_outcome()
        yield {"event": "done", "result": inv}

    def close(self) -> None:
        """Shut the engine down (its workers too); the model cannot run afterwards."""
        if self.closed:
            return
        object.__setattr__(self, "closed", True)
        if self.loop is not None:
            self.loop.close()
        try:
            self.llm.collective_rpc(rpc_shutdown)
        except Exception:  # noqa: BLE001 - best effort
            pass
        _shutdown_engine(self.llm)
        _TorchSettingsGuard.closed()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __copy__(self):
        """A shallow copy sharing the engine (``model.edit`` clones the root envoy); pickling stays refused."""
        new = object.__new__(type(self))
        for name, value in vars(self).items():
            object.__setattr__(new, name, value)
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


def _shutdown_engine(llm):
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass
