"""The wrapped model: the root envoy plus the entry points that run it.

``ai.wrap(module)`` returns a :class:`Model`. It is the root of the envoy
tree (``model.layers[3]``) and a thin facade over jobs: ``trace`` in
scripts, ``atrace`` in async code, or a ``with model.trace() as tr:`` block
with several invokes make a :class:`~asyncinterp.job.Job` and hand it to the
engine that :meth:`Model.engine` names. Language models and vLLM bring their
own engines; the model classes only say which.
"""

from __future__ import annotations

import threading
from threading import get_ident

from .engine import ForwardEngine
from .hooks.envoy import Envoy, special_envoy_class
from .hooks.modules import submodules
from .kernel.errors import NotInRunError
from .kernel.scheduler import current_kernel, current_task
from .hooks.order import CallOrder, OrderRecorder
from .job import Trace, one_invoke_job
from .kernel.tasks import Steps

_NOTHING = object()


class _ModelLock:
    """One run per model at a time, with a clear error for re-entry from the same thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self._owner = None

    def acquire(self, timeout):
        me = get_ident()
        if self._owner == me:
            raise RuntimeError(
                "this model is already running a trace in this thread (a trace started from inside an "
                "intervention?); run it after the current trace ends, or use a session")
        lock = self._lock
        ok = lock.acquire(False) or lock.acquire(True, timeout)   # uncontended: no timed wait
        if ok:
            self._owner = me
        return ok

    def release(self):
        self._owner = None
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()


class Model(Envoy):
    """Root envoy of a wrapped ``nn.Module`` and the entry points to run it."""

    lock_timeout = 600.0

    def __init__(self, module, envoys: dict | None = None):
        Envoy.__init__(self, module, "")
        init = object.__setattr__
        init(self, "run_lock", _ModelLock())
        init(self, "call_order", None)      # the recorded module call order (hooks/order.py), after a first run
        init(self, "_envoy_classes", dict(envoys or {}))
        init(self, "_edits", ())
        init(self, "attachments", {})       # name -> envoy of a module attached with attach()
        init(self, "_engine", None)

    # ------------------------------------------------------------ structure
    def envoy_class_for(self, module):
        classes = self._envoy_classes
        if classes:
            for cls in type(module).__mro__:
                if cls in classes:
                    return classes[cls]
        return special_envoy_class(module)

    def needs_order_recording(self) -> bool:
        """True until one complete run has recorded the module call order."""
        order = self.call_order
        return order is None or not order.complete

    def start_order_recording(self) -> OrderRecorder:
        """Record the module call order during the next forward (this thread only); ``stop()`` it after."""
        order = CallOrder()
        object.__setattr__(self, "call_order", order)
        return OrderRecorder(self.module, order).__enter__()

    def finish_order_recording(self, recorder) -> None:
        recorder.stop()
        if not recorder.order.complete:
            object.__setattr__(self, "call_order", None)

    # -------------------------------------------------------------- running
    def engine(self, kind: str = "trace"):
        """The engine that runs this model's jobs of ``kind`` (``"trace"``; generating models: ``"generate"``)."""
        if kind != "trace":
            raise ValueError(f"a wrapped {type(self.module).__name__} runs only traces (one forward pass); "
                             "generation needs a LanguageModel or VLLM")
        engine = self._engine
        if engine is None or engine.model is not self:   # (a copy made by model.edit gets its own)
            engine = ForwardEngine(self)
            object.__setattr__(self, "_engine", engine)
        return engine

    def scan(self, input, fn=None, modules=None, **options):
        """Shapes and dtypes of hook points from a forward pass with fake tensors (see asyncinterp.tools.scan)."""
        from .tools.scan import scan
        return scan(self, input, fn, modules, **options)

    def session(self, keep: bool = False):
        """A :class:`~asyncinterp.tools.session.Session` whose runs default to this model."""
        from .tools.session import Session
        return Session(self, keep=keep)

    # ------------------------------------------------------------- attached
    def attach(self, name: str, module) -> Envoy:
        """Attach a new module (an SAE, a probe, a transcoder) to this wrapped model as ``m.<name>``.

        The wrapped ``nn.Module`` is not changed. Inside a run, calling
        ``m.<name>(x)`` runs ``module`` for real, so its own hook points fire:
        another task (or a sub-task: ``ai.spawn(m.sae.encoder.output)``) can
        await them, read and replace them like any point. Splice it into the
        model by replacing a point with its output, in an intervention or in a
        persistent edit (``model.edit``). Returns the new envoy.
        """
        import torch
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"model.attach({name!r}, ...) needs an nn.Module, got {type(module).__name__}")
        if not name.isidentifier() or name.startswith("_"):
            raise ValueError(f"model.attach: {name!r} must be a Python identifier not starting with '_'")
        if name in submodules(self.module) or name in self.attachments or hasattr(type(self), name) \
                or hasattr(self.module, name):
            raise ValueError(f"model.attach: {name!r} is already a submodule or attribute of this model; "
                             "choose another name")
        envoy = self.envoy_class_for(module)(module, name, self, self)
        object.__setattr__(envoy, "attached", True)
        self.attachments[name] = envoy
        self.forget_name(name)   # a standard name read before (``embed``) now means the attached module
        return envoy

    def detach(self, name: str) -> None:
        """Remove a module attached with :meth:`attach`."""
        if name not in self.attachments:
            raise KeyError(f"no module named {name!r} is attached to this model")
        del self.attachments[name]

    # ---------------------------------------------------------------- edits
    def edit(self, fn, inplace: bool = False) -> "Model":
        """A model whose every later run also runs ``fn(m)`` on each forward pass (see asyncinterp.tools.edit).

        Returns a new wrapped model over the same module; ``inplace=True``
        edits this one. ``remove_edits()`` restores the original behaviour.
        """
        from .tools.edit import edit
        return edit(self, fn, inplace=inplace)

    @property
    def edits(self) -> tuple:
        """The persistent edits of this model, in the order they run."""
        return self._edits

    @edits.setter
    def edits(self, fns) -> None:
        object.__setattr__(self, "_edits", tuple(fns))

    def remove_edits(self, fn=None) -> None:
        """Remove every persistent edit (or only ``fn``)."""
        from .tools.edit import remove_edits
        remove_edits(self, fn)

    def trace(self, input=_NOTHING, *fns, on_error: str = "stop", **kwargs):
        """Run one forward pass with interventions.

        ``model.trace(x, fn)`` returns what ``fn`` returns (a tuple for several
        functions). ``model.trace()`` returns a :class:`Trace` to fill with
        ``tr.invoke(input, fn)`` inside a ``with`` block.
        """
        if input is _NOTHING and not fns:
            return Trace(self, "trace", on_error)
        engine = self.engine("trace")
        edits = self._edits
        if edits:
            trace = Trace(self, "trace", on_error, engine=engine)
            inv = trace.invoke(None if input is _NOTHING else input, *fns, **kwargs)
            execution = trace.start()
        else:   # one invoke: the job is made directly (the common case, kept short)
            inv = engine.make_invoke(0, None if input is _NOTHING else input, fns, kwargs, False)
            execution = engine.start(one_invoke_job(inv, on_error))
        execution.wait()
        if not inv.fns:
            return execution.output
        return inv.result

    async def atrace(self, input=_NOTHING, *fns, on_error: str = "stop", **kwargs):
        """``trace`` for async code: the forward runs in a worker thread, the event loop stays free.

        Cancelling the awaiting task stops the forward at its next hook point.
        """
        from .aio import run_in_thread
        if input is _NOTHING and not fns:
            raise TypeError("atrace needs an input and an intervention; for several invokes use "
                            "`async with model.trace() as tr:` or `await tr.arun()`")
        trace = Trace(self, "trace", on_error)
        inv = trace.invoke(None if input is _NOTHING else input, *fns, **kwargs)
        execution = trace.start()
        await run_in_thread(execution)
        if not inv.fns:
            return execution.output
        return inv.result

    # ---------------------------------------------------- inside a run only
    def stop(self) -> None:
        """Stop the model after the current hook point; results of finished interventions are kept."""
        kernel = current_kernel()
        if kernel is None:
            raise NotInRunError("model.stop() can only be called inside an intervention")
        kernel.host.request_stop(current_task())

    def backward(self, tensors, **kwargs):
        """``await m.backward(loss)``: a backward pass that resumes tasks waiting on ``.grad`` points."""
        from .hooks.grad import backward
        return backward(tensors, **kwargs)

    def steps(self, start: int | None = None, stop: int | None = None) -> Steps:
        """``async for step in m.steps():`` one iteration per forward pass (generation step).

        Takes ``range``'s arguments over step numbers (0 is the first pass):
        ``m.steps(3)`` is steps 0-2, ``m.steps(2, 5)`` steps 2-4, ``m.steps(2, None)``
        every step from 2 on. Leaving the loop with ``break`` (or ``return``)
        ends the generation once every intervention of the run has finished
        (like ``m.stop()``); see docs/generation.md.
        """
        return Steps(start, stop)


def wrap(module, envoys: dict | None = None) -> Model:
    """Wrap any ``nn.Module``. The module itself is not modified."""
    return Model(module, envoys=envoys)
