"""A job in the live vLLM engine: its requests' way through the engine loop, from admission to results.

:meth:`VLLMEngine.start <.engine.VLLMEngine.start>` turns a frozen job into a
:class:`LiveJob`, the execution that ``run.run()``, ``atrace``/``agenerate``
and serving wait on and cancel. It never hosts a kernel: the interventions run
with the model, in a :class:`~.worker.WorkerRun` (in this process, or in every
tensor-parallel worker). What it does is the bookkeeping of the engine loop
(:mod:`.loop`), always in the loop's thread:

* ``admit``: add one vLLM request per invoke with a prompt, and open the
  worker run with the job's interventions (a job without any opens none);
* ``before_step``: abort the requests of a cancelled job or invoke;
* ``after_step``: hand each request its new tokens, and act on what the worker
  run reports (a stop, a halt, values emitted for the listener);
* ``close``: close the worker run, give each result carrier the outcomes of
  its interventions, wake whoever waits and the listener.

The caller's side is the execution protocol (:class:`asyncinterp.engine.Execution`):
``wait()`` submits the job and waits for it, ``cancel()``/``cancel_invoke(i)``
abort requests from any thread.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Mapping

from ...kernel.errors import RunCancelled
from .environment import COMPILE_HINT, HooksUnavailableError
from .loop import EngineClosed
from .requests import VLLMInvoke, request_params
from .worker import rpc_close, rpc_open

__all__ = ["LiveJob"]

log = logging.getLogger("asyncinterp.vllm")


class LiveJob:
    """A job (trace or generation) of a :class:`~.driver.VLLM` model in the engine's live loop.

    It joins the engine between two steps, beside whatever else runs there,
    and is done when its own requests finish. The job's ``listener``
    (serving) is an object whose ``on_output(invoke)``, ``on_event(index,
    item)`` and ``on_finish(live_job)`` the loop thread calls as the job's
    requests produce tokens, its interventions emit values, and when it is done.
    """

    layout = None   # the flat token layout changes every engine step and lives with the model (WorkerRun)

    def __init__(self, engine, job):
        model = engine.model
        if model.closed:
            raise EngineClosed("this VLLM model was closed")
        if not any(spec.input is not None for spec in job.invokes):
            raise ValueError("no invoke has a prompt: give at least one invoke a prompt to run the model on")
        self.model = model
        self.job = job
        self.invokes = job.results or tuple(VLLMInvoke(i, spec) for i, spec in enumerate(job.invokes))
        self.on_error = job.on_error
        self.listener = job.listener
        for inv in self.invokes:
            if inv.spec.input is None:
                continue
            if not isinstance(inv, VLLMInvoke):
                raise TypeError(f"invoke {inv.index} has a prompt, so its result carrier must be a VLLMInvoke "
                                f"(made by model.engine(kind).make_invoke), got {type(inv).__name__}")
            if inv.prompt_ids is None:
                inv.prompt_ids = engine.prompt_of(inv.spec.input)
            if inv.params is None or job.generation:   # else made once already, by make_invoke, from the same options
                inv.params = request_params(job.kind, job.generation, inv.spec.options)
                inv.lora_request = model.lora.request(inv.spec.options.get("adapter",
                                                                           (job.generation or {}).get("adapter")))
        self.key = None               # the job key (the loop sets it)
        self.pending = set()          # ids of this job's requests still in the engine
        self.submitted = False
        self.opened = False           # its worker run is open (it has interventions)
        self.halted = False
        self.cancelled = False
        self.done = False
        self.output = None
        self.stopped = False
        self.error = None             # what ended the job from outside its interventions (admission, engine)
        self.aborted = False          # its requests were aborted because the job was cancelled
        self.failures = []
        self.finished_event = threading.Event()
        self._by_id = {}
        self._cancels = [inv.index for inv in self.invokes if inv.cancelled]   # cancelled before it started
        self._stop_seen = set()
        self._stepped = False
        for inv in self.invokes:
            inv.bind(self)

    @property
    def intervened(self) -> bool:
        """Some invoke has interventions (its requests then get their own KV blocks, see :meth:`cache_salt`)."""
        return self.job.intervened

    @property
    def context(self) -> Mapping:
        """The job's values for interventions and tools (handed to the worker run in process)."""
        return self.job.context

    # ------------------------------------------------------------------ any thread
    def submit(self, loop=None) -> None:
        """Queue the job in the engine's live loop without waiting (it joins before the next step)."""
        if self.submitted:
            raise RuntimeError("this job was already submitted to the engine; build a new one to run it again")
        loop = loop or self.model.live_loop()
        self.submitted = True
        loop.submit(self)

    def wait(self, cancellable: bool = False) -> None:
        """Submit the job (unless :meth:`submit` did) and wait until its requests have finished.

        Raises what ended it (engine error, cancellation) or its failures
        (``on_error="stop"``). Cancellation is always possible (``cancellable`` is accepted for the protocol).
        """
        loop = self.model.live_loop()
        if loop.in_loop_thread():
            raise RuntimeError("a vLLM run cannot start another run of the same engine from inside an intervention "
                               "(it would wait for the step the intervention is part of)")
        if not self.submitted:
            self.submit(loop)
        while not self.finished_event.wait(1.0):
            pass
        self.raise_outcome()

    def cancel(self) -> None:
        """Thread-safe: abort the requests before the next engine step; ``wait`` raises ``RunCancelled``."""
        self.cancelled = True
        self._wake()

    def cancel_invoke(self, index) -> None:
        """Thread-safe: abort invoke ``index``'s request before the next step and close its interventions."""
        self._cancels.append(index)
        self._wake()

    def _wake(self):
        loop = self.model.loop
        if loop is not None:
            loop.wake()

    def raise_outcome(self) -> None:
        """After the job: raise what ended it (engine error, cancellation) or its failures (``on_error="stop"``)."""
        if self.error is not None:
            raise self.error
        if self.aborted and self.cancelled:
            raise RunCancelled("the run was cancelled; its requests were aborted before the next engine step and "
                               "its hooks removed (the engine went on with the other requests)")
        failures = self.failures
        if failures and self.on_error == "stop":
            if len(failures) == 1:
                raise failures[0]
            group = ExceptionGroup if all(isinstance(f, Exception) for f in failures) else BaseExceptionGroup
            raise group(f"{len(failures)} interventions failed", list(failures))

    # ------------------------------------------------------------------ in the engine loop's thread
    def admit(self, loop) -> bool:
        """Add the requests and open the worker run. ``False``: the job failed and is already finished.

        Each request gets :meth:`cache_salt`'s salt (the prefix cache is shared only between equal salts).
        """
        model = self.model
        engine = loop.engine
        internal = {}
        try:
            for inv in self.invokes:
                if inv.spec.input is None:
                    continue
                ext = f"{self.key}-{inv.index}"
                prompt = {"prompt_token_ids": list(inv.prompt_ids)}
                salt = self.cache_salt(inv)
                if salt is not None:
                    prompt["cache_salt"] = salt
                internal[inv.index] = engine.add_request(ext, prompt, inv.params, lora_request=inv.lora_request)
                inv.request_id = ext
                self._by_id[ext] = inv
                self.pending.add(ext)
            if self.intervened:
                # the job's own invoke specs, without their prompts (the engine has them), and each one's request
                payload = {"requests": [internal.get(inv.index) for inv in self.invokes],
                           "invokes": tuple(inv.spec.replace(input=None, captured=()) for inv in self.invokes)}
                job = self.job
                options = {"kind": job.kind, "on_error": job.on_error, "stop_per_invoke": job.stop_per_invoke}
                if model.tp > 1:
                    payload = _dumps(payload)
                else:
                    options["context"] = job.context   # (in process only: it may hold unpicklable tables)
                self.opened = True
                model.rpc(rpc_open, self.key, options, payload)
                # a task may have failed or stopped before the first step: then no step is needed
                self.after_step(engine, (), model.poll([self.key]).get(self.key), False)
        except BaseException as exc:  # noqa: BLE001 - this job fails alone
            self.fail(exc)
            self.close()
            return False
        return True

    def cache_salt(self, inv) -> str | None:
        """The ``cache_salt`` of ``inv``'s vLLM request: vLLM shares KV blocks only between equal salts.

        A job with interventions gives each of its requests a salt of its own, whatever its input asked
        for: its blocks are neither read from vLLM's prefix cache (so it sees, and can edit, every prompt
        position) nor reused by any other request (so its edits cannot leak into another request's
        outputs). A plain request shares the cache: with everybody (no salt), or, when its input is a
        mapping with a ``cache_salt`` (as vLLM's prompts take), with the requests that give the same salt.
        Those salts are namespaced (``user-...``) so that no input can name one of ours (``asyncinterp-...``).

        An input mapping may also carry a ``cache_scope`` (a string): then its interventions are vouched for
        as changing each position the same way whatever else is in the run (a steering vector, an
        ablation: the server's named edits), and the request shares KV blocks with the requests of the same
        scope (and ``cache_salt``) only (``scope-...``: neither plain requests nor other scopes).
        """
        input = inv.spec.input
        scope = input.get("cache_scope") if isinstance(input, Mapping) else None
        salt = input.get("cache_salt") if isinstance(input, Mapping) else None
        if scope is not None:
            return f"scope-{scope}" + ("" if salt is None else f"-user-{salt}")
        if self.intervened:
            return f"asyncinterp-{os.getpid()}-{self.key}-{inv.index}"
        return None if salt is None else f"user-{salt}"

    def before_step(self, engine) -> None:
        """Apply cancellations: the job's (or some invokes') requests leave the engine now."""
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
        """Take this step's outputs of the job's requests and what its worker run reports."""
        halted = False
        ended = ()
        listener = self.listener
        if status is not None:
            halted, steps, stopped, events = status
            if outs and not self._stepped and not halted and steps == 0:
                raise HooksUnavailableError(
                    f"the engine ran a step but asyncinterp's hooks on {type(self.model.module).__name__} did not "
                    f"fire. {COMPILE_HINT}.")
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
                inv.add_prompt_logprobs(getattr(out, "prompt_logprobs", None))
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
                _abort(self.model.llm_engine, list(self.pending))
            except Exception:  # noqa: BLE001 - the engine may be broken; the job fails anyway
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
        """Close the worker run, give the result carriers their outcomes, wake the caller and the listener."""
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
            self.output = [inv for inv in self.invokes if inv.spec.input is not None]
            self.failures = list(failures or ())
            for inv, outs in zip(self.invokes, outcomes or [() for _ in self.invokes]):
                if isinstance(inv, VLLMInvoke):
                    inv.outcomes = tuple(outs)
                inv.finish()
            listener = self.listener
            self.finished_event.set()
            if listener is not None:
                try:
                    listener.on_finish(self)
                except Exception:  # noqa: BLE001 - a listener must not break the loop
                    log.exception("vLLM run listener failed")

    def __repr__(self):
        state = "done" if self.done else "in the engine" if self.submitted else "not submitted"
        return f"<LiveJob {self.job.kind} of {len(self.invokes)} invokes ({state})>"


def _abort(engine, ids):
    try:
        engine.abort_request(list(ids), internal=False)
    except TypeError:  # older signature
        engine.abort_request(list(ids))


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

    for spec in payload["invokes"]:
        for fn in spec.fns:
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
