"""Engines take jobs: the one interface between "what is asked" and "what runs it".

A :class:`~asyncinterp.job.Job` says what to run; an engine runs it. Each kind
of execution is an engine beside the others, never a subclass of another:

============================  ===============================================================
engine                        where
============================  ===============================================================
:class:`ForwardEngine`        one forward of any wrapped ``nn.Module`` (this module)
``LMForwardEngine``           one forward of a transformers LM, prompts left-padded (``models.hf.runs``)
``LMGenerateEngine``          a transformers generation, one kernel step per pass (``models.hf.runs``)
``VisionForwardEngine``       one forward of a vision-language model, images per invoke (``models.hf.vision``)
``VisionGenerateEngine``      its generation (``models.hf.vision``)
``VLLMEngine``                a job joining the live vLLM engine loop (``models.vllm``)
``ScanEngine``                any engine's forward with fake tensors (``tools.scan``)
``Batcher`` (serving front)    submissions coalesced into one job (``serve.scheduling.batcher``)
============================  ===============================================================

An engine does two things. :meth:`Engine.make_invoke` checks one invoke while
a job is being built (so a bad input or intervention fails at ``tr.invoke``,
on the caller's line) and returns its result carrier; :meth:`Engine.start`
takes the frozen job and returns an :class:`Execution`: ``wait()`` runs it (or
waits for it), ``cancel()``/``cancel_invoke(i)`` stop it from another thread.
For the in-process engines the execution is the kernel's host itself, a
:class:`~asyncinterp.run.Run`.
"""

from __future__ import annotations

from inspect import CO_COROUTINE
from types import FunctionType
from typing import Any, Protocol

from .invoke import Invoke
from .job import EMPTY, InvokeSpec, binds_nothing, capture, check_intervention, check_kwargs, frozen_mapping, split_input
from .run import Run

__all__ = ["Engine", "Execution", "ForwardEngine", "describe_invoke"]

new_spec = tuple.__new__   # an InvokeSpec from its six fields, already checked (describe_invoke is on every trace)


class Execution(Protocol):
    """A started job: what ``run()``, ``atrace`` and serving wait on and cancel."""

    done: bool
    output: Any
    stopped: bool

    def wait(self, cancellable: bool = False) -> None:
        """Run the job to its end (or wait for it); raises its failures as ``on_error`` says.

        ``cancellable``: another thread may call :meth:`cancel` meanwhile (adds checkpoints).
        """

    def cancel(self) -> None:
        """Thread-safe: stop at the next hook point; ``wait`` raises ``RunCancelled``."""

    def cancel_invoke(self, index: int) -> None:
        """Thread-safe: close invoke ``index``'s interventions at the next hook point; the others go on."""


class Engine(Protocol):
    """Runs jobs on one model."""

    model: Any

    def make_invoke(self, index: int, input, fns: tuple, kwargs: dict, deferred: bool) -> Invoke:
        """Check one invoke of a job being built; return its result carrier (its ``spec`` is the job's part).

        ``deferred``: the job runs later (a ``with`` block), so capture what the interventions read now.
        """

    def start(self, job) -> Execution:
        """Take a frozen job; nothing runs until the execution's ``wait()``."""


def describe_invoke(index, input, fns, kwargs, deferred, invoke_class=Invoke, options=None) -> Invoke:
    """The common checks of an invoke and its result carrier (engines add their own around it)."""
    if fns:
        for fn in fns:
            if type(fn) is not FunctionType or not fn.__code__.co_flags & CO_COROUTINE:   # else: an `async def`
                check_intervention(fn)
    else:
        input, fns = split_input(input, fns)
    if kwargs:
        check_kwargs(kwargs)
        kwargs = frozen_mapping(kwargs)
    else:
        kwargs = EMPTY
    if type(fns) is not tuple:
        fns = tuple(fns)
    if deferred and fns and (len(fns) > 1 or type(fns[0]) is not FunctionType or fns[0].__code__ not in binds_nothing):
        captured = capture(fns)
    else:
        captured = ()   # run at once, or an intervention that reads no variable (the common case)
    return invoke_class(index, new_spec(InvokeSpec, (input, fns, kwargs, frozen_mapping(options) if options else EMPTY,
                                                     captured, False)))


class ForwardEngine:
    """One forward pass of a wrapped ``nn.Module``: the invokes' inputs concatenated along dim 0."""

    def __init__(self, model):
        self.model = model

    make_invoke = staticmethod(describe_invoke)

    def start(self, job) -> Run:
        return Run(self.model, job)
