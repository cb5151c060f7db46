"""A job: the description of the work, separate from the forward that runs it.

Every way of running interventions makes a :class:`Job` and hands it to an
engine (:mod:`asyncinterp.engine`): a plain forward, a transformers
generation, the vLLM engine loop, a scan with fake tensors, a batch that a
serving front coalesced. A job says *what* is asked:

* its invokes (:class:`InvokeSpec`): the input, the interventions, the model
  keyword arguments, per-invoke options (e.g. vLLM sampling), and what the
  interventions captured when they were added;
* its options: ``kind`` (``"trace"`` or ``"generate"``), ``on_error``,
  ``stop_per_invoke``, the generation options, a ``context`` for the
  interventions and tools;
* where results go: ``results``, one result carrier per invoke (an
  :class:`~asyncinterp.invoke.Invoke`, what ``run.invoke`` returns), and an
  optional ``listener`` that hears tokens and events as they are produced.

A job is built once, frozen, and never changed after it is submitted: it can
be inspected, compared (``results`` and ``listener`` are where results go,
not part of what is asked, so they take no part in equality) and turned into
bytes and back by the wire (:func:`asyncinterp.serve.jobs.job_wire.dumps_job`). The
kernel's host while a forward runs (:class:`asyncinterp.run.Run`) is made
from a job by the engine and lives only as long as that forward.

This module also holds what an invoke captures when it is added (the late-
binding check: a closure variable rebound between ``run.invoke`` and the run)
and the check that a callable can be an intervention.
"""

from __future__ import annotations

import dis
import functools
import inspect
import types
import weakref
from operator import itemgetter
from types import FunctionType, MappingProxyType

from .invoke import Invoke
from .kernel.errors import AsyncInterpError
from .kernel.task import callable_name, is_async_fn

__all__ = ["EMPTY", "InvokeSpec", "Job", "LateBindingError", "Trace", "one_invoke_job", "capture", "check_captured",
           "check_intervention", "check_kwargs", "check_on_error", "edit_invoke", "frozen_mapping", "is_async_fn", "split_input"]

#: the empty frozen mapping (the default of every mapping field of a job)
EMPTY = MappingProxyType({})


def frozen_mapping(value) -> MappingProxyType:
    """A read-only copy of ``value`` (a mapping or ``None``)."""
    if not value:
        return EMPTY
    if type(value) is MappingProxyType:
        return value
    return MappingProxyType(dict(value))


class _Frozen(tuple):
    """A plain value with named fields that cannot be changed after it is made.

    A tuple underneath (a job is made for every trace, and a tuple is the
    cheapest immutable record Python has); each field is a read-only
    property. ``_compared`` is how many leading fields take part in equality.
    """

    __slots__ = ()
    _fields = ()
    _compared = 0

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        n = self._compared
        return tuple.__eq__(self[:n], other[:n])

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = None

    def replace(self, **changes):
        """A copy with ``changes`` (this one is frozen)."""
        fields = dict(zip(self._fields, self))
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field(s) {sorted(unknown)}; its fields are {list(fields)}")
        fields.update(changes)
        return type(self)(**fields)

    def __repr__(self):
        shown = ", ".join(f"{f}={v!r}" for f, v in zip(self._fields[:self._compared], self))
        return f"{type(self).__name__}({shown})"

    def __reduce__(self):
        return (type(self), tuple(self))


def _fields(cls):
    """Give ``cls`` a read-only property per name in ``cls._fields`` (item i of the tuple)."""
    for i, name in enumerate(cls._fields):
        setattr(cls, name, property(itemgetter(i), doc=f"field {i} of the {cls.__name__}"))
    return cls


@_fields
class InvokeSpec(_Frozen):
    """One invoke of a job: an input (``None``: it sees the whole batch) and the interventions that see its rows.

    ``kwargs``: keyword arguments for the model's forward; ``options``: per-invoke engine
    options (vLLM: sampling); ``captured``: ``(function, name, holder, value)`` for each
    variable the interventions read, as bound when the invoke was added (the late-binding
    check); ``background``: it runs beside the others (persistent edits) and keeps no
    generation going.
    """

    __slots__ = ()
    _fields = ("input", "fns", "kwargs", "options", "captured", "background")
    _compared = 6

    def __new__(cls, input=None, fns: tuple = (), kwargs=EMPTY, options=EMPTY, captured: tuple = (),
                background: bool = False):
        return tuple.__new__(cls, (input, fns, kwargs, options, captured, background))


@_fields
class Job(_Frozen):
    """The description of one run of interventions (see the module docs).

    ``invokes``: its :class:`InvokeSpec` s; ``kind``: ``"trace"`` (one forward) or
    ``"generate"``; ``on_error``: ``"stop"`` (a failure stops the run) or ``"continue"``
    (it fails only its own invoke); ``stop_per_invoke``: ``m.stop()`` ends only the
    caller's invoke (serving); ``generation``: ``max_new_tokens``, sampling, ``stop``...;
    ``context``: values for the interventions and tools (serving: its requests).
    Where results go takes no part in equality: ``results`` (one result carrier per
    invoke) and ``listener`` (hears tokens and events as they are produced).
    """

    __slots__ = ()
    _fields = ("invokes", "kind", "on_error", "stop_per_invoke", "generation", "context", "results", "listener")
    _compared = 6

    def __new__(cls, invokes: tuple = (), kind: str = "trace", on_error: str = "stop", stop_per_invoke: bool = False,
                generation=EMPTY, context=EMPTY, results: tuple = (), listener=None):
        if on_error != "stop" and on_error != "continue" or kind != "trace" and kind != "generate" \
                or results and len(results) != len(invokes):
            _refuse(invokes, kind, on_error, results)
        return tuple.__new__(cls, (invokes, kind, on_error, stop_per_invoke, generation, context, results, listener))

    @property
    def intervened(self) -> bool:
        """Whether some invoke has interventions."""
        return any(spec.fns for spec in self.invokes)


def one_invoke_job(invoke, on_error: str) -> Job:
    """The job of ``model.trace(x, fn)``: one invoke, no options (the common case, built without the general checks)."""
    if on_error != "stop" and on_error != "continue":
        check_on_error(on_error)
    return tuple.__new__(Job, ((invoke.spec,), "trace", on_error, False, EMPTY, EMPTY, (invoke,), None))


def check_on_error(on_error) -> None:
    """Raise a clear ``ValueError`` unless ``on_error`` is ``"stop"`` or ``"continue"``."""
    if on_error != "stop" and on_error != "continue":
        raise ValueError(f"on_error must be 'stop' (a failing intervention stops the run) or 'continue' "
                         f"(it fails only its own invoke), got {on_error!r}")


def _refuse(invokes, kind, on_error, results):
    check_on_error(on_error)
    if kind != "trace" and kind != "generate":
        raise ValueError(f"a job's kind is 'trace' or 'generate', got {kind!r}")
    raise ValueError(f"a job has {len(invokes)} invokes but {len(results)} result carriers")


# ----------------------------------------------------------------------- building a job
class Trace:
    """A job being built: ``with model.trace() as run: run.invoke(...)`` runs it on exit.

    ``run.invoke(input, fn)`` adds an invoke and returns its result carrier
    (an :class:`~asyncinterp.invoke.Invoke`); ``run.run()`` (or leaving the
    ``with`` block) freezes the :attr:`job` and hands it to the model's
    engine. Once frozen the job does not change: a second ``run()`` is an
    error. After the run, ``output`` is the model's output and ``stopped``
    says whether it was stopped early.
    """

    def __init__(self, model, kind: str = "trace", on_error: str = "stop", *, generation=None,
                 stop_per_invoke: bool = False, engine=None):
        check_on_error(on_error)
        self.model = model
        self.engine = model.engine(kind) if engine is None else engine
        self.kind = kind
        self.on_error = on_error
        self.stop_per_invoke = stop_per_invoke
        self.generation = generation
        self.context = {}                  # values for the interventions and tools (frozen into the job)
        self.listener = None               # hears tokens and events as they are produced (serving)
        self.invokes = []                  # the result carriers handed out, in order
        self.execution = None              # what runs the job, once started
        self._job = None
        edits = model.edits                # a job takes the model's persistent edits as they are when it is made
        self._background = [edit_invoke(edits)] if edits else ()

    # ------------------------------------------------------------------ building
    def invoke(self, input=None, *fns, **kwargs) -> Invoke:
        """Add an input (``None``: the invoke sees the whole batch) and its interventions; returns its result."""
        if self._job is not None:
            raise RuntimeError("this trace's job was already submitted; build a new one with model.trace()")
        inv = self.engine.make_invoke(len(self._background) + len(self.invokes), input, fns, kwargs, True)
        self.invokes.append(inv)
        return inv

    @property
    def job(self) -> Job:
        """The frozen description of this trace (built on first use; no invoke can be added after).

        Raises :class:`LateBindingError` if a variable an intervention reads was rebound since its invoke
        was added (a loop variable, typically).
        """
        job = self._job
        if job is None:
            for inv in self.invokes:   # the late-binding check: what the interventions read, as bound when added
                if inv.spec.captured:
                    check_captured(inv.spec, inv.index)
            carriers = (*self._background, *self.invokes)
            job = self._job = Job(tuple([inv.spec for inv in carriers]), self.kind, self.on_error,
                                  self.stop_per_invoke, frozen_mapping(self.generation), frozen_mapping(self.context),
                                  carriers, self.listener)
        return job

    # ------------------------------------------------------------------ running
    def start(self):
        """Submit the job to the engine without waiting (the execution's ``wait()`` runs it)."""
        if self.execution is not None:
            raise RuntimeError("this trace has already run; build a new one with model.trace()")
        execution = self.execution = self.engine.start(self.job)
        return execution

    def run(self):
        """Execute the job with every invoke added so far; returns ``self``."""
        self.start().wait()
        return self

    async def arun(self):
        """Like :meth:`run`, from async code (the forward runs in a worker thread)."""
        from .aio import run_in_thread
        await run_in_thread(self.start())
        return self

    def cancel(self) -> None:
        """Thread-safe: stop the run at its next hook point (it raises ``RunCancelled``)."""
        execution = self.execution
        if execution is not None:
            execution.cancel()

    @property
    def done(self) -> bool:
        return self.execution is not None and self.execution.done

    @property
    def output(self):
        """The model's output (after the run)."""
        return None if self.execution is None else self.execution.output

    @property
    def stopped(self) -> bool:
        """Whether the run was stopped early (``m.stop()``)."""
        return self.execution is not None and self.execution.stopped

    @property
    def layout(self):
        """How the executed batch was split into invokes (after the run)."""
        return None if self.execution is None else self.execution.layout

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None and self.execution is None:
            self.run()
        return False

    async def __aenter__(self):
        return self

    async def __aexit__(self, exc_type, exc, tb):
        if exc_type is None and self.execution is None:
            await self.arun()
        return False

    def __repr__(self):
        state = "done" if self.done else "running" if self.execution is not None else "building"
        return f"<{type(self).__name__} {self.kind} of {len(self.invokes)} invokes ({state})>"


def edit_invoke(edits) -> Invoke:
    """The first invoke of a job on an edited model: no input, one background task per edit, every step."""
    return Invoke(0, InvokeSpec(None, tuple(_every_step(fn) for fn in edits), background=True))


def _every_step(fn):
    async def edit_task(m):
        async for _ in m.steps():
            await fn(m)
    edit_task.__qualname__ = f"edit {getattr(fn, '__qualname__', repr(fn))}"
    return edit_task


# ----------------------------------------------------------------------- what an invoke captures
class LateBindingError(AsyncInterpError):
    """A variable an intervention closes over was rebound between ``run.invoke`` and the run."""


def capture(fns) -> tuple:
    """What ``fns`` read from closure variables and globals, as bound now (see :func:`check_captured`)."""
    if len(fns) == 1:
        fn = fns[0]
        if type(fn) is FunctionType and fn.__code__ in binds_nothing:   # (most interventions read nothing)
            return ()
        return tuple(_bound_names(fn))
    return tuple(c for fn in fns for c in _bound_names(fn))


def check_captured(spec: InvokeSpec, index: int) -> None:
    """Raise :class:`LateBindingError` if a variable ``spec``'s interventions read was rebound since it was added."""
    for fn, name, holder, value in spec.captured:
        if type(holder) is dict:
            now = holder.get(name, _UNBOUND)
        else:
            try:
                now = holder.cell_contents
            except ValueError:
                now = _UNBOUND
        if now is not value:
            raise LateBindingError(
                f"intervention {callable_name(fn)} of invoke {index} uses the variable {name!r}, which was "
                f"{_short(value)} when the invoke was added and is {_short(now)} now that the run starts: "
                "Python closures see a variable's latest value (a loop variable ends at its last value), so "
                "every invoke would use the same one. Bind it when adding the invoke: "
                f"`async def fn(m, {name}={name}): ...` or functools.partial(fn, {name}={name}).")


def _bound_names(fn):
    """``(function, name, holder, value)`` for each closure variable and global ``fn`` reads, as bound now.

    ``holder`` is the closure cell, or the function's globals dict. Names that
    hold modules, classes and functions are left out (rebinding those is not
    the loop-variable mistake this guards against).
    """
    if type(fn) is FunctionType:
        code = fn.__code__
    else:
        while isinstance(fn, functools.partial):
            fn = fn.func
        fn = getattr(fn, "__func__", fn)
        code = getattr(fn, "__code__", None)
        if code is None:
            return ()
    names = _names_of_code.get(code)
    if names is None:
        names = _global_names(code)
    if not names and not code.co_freevars:
        binds_nothing.add(code)
        return ()
    out = []
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:   # not bound yet
            continue
        if not isinstance(value, _DEFINITIONS):
            out.append((fn, name, cell, value))
    glob = fn.__globals__
    for name in names:
        value = glob.get(name, _UNBOUND)
        if value is not _UNBOUND and not isinstance(value, _DEFINITIONS):
            out.append((fn, name, glob, value))
    return out


_names_of_code = {}      # code object -> the global names it (or its nested code) reads (code objects are few)
binds_nothing = set()   # code objects with no closure variables and no global reads (capture skips them)
_GLOBAL_LOADS = frozenset(("LOAD_GLOBAL", "LOAD_NAME"))
_DEFINITIONS = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)
_UNBOUND = object()


def _global_names(code):
    """The global names ``code`` (or code nested in it) reads: its ``LOAD_GLOBAL``s, not its attribute names."""
    names = _names_of_code.get(code)
    if names is None:
        found = {ins.argval for ins in dis.get_instructions(code) if ins.opname in _GLOBAL_LOADS}
        for const in code.co_consts:
            if hasattr(const, "co_names"):   # comprehensions, nested functions
                found.update(_global_names(const))
        if len(_names_of_code) > 100_000:
            _names_of_code.clear()
            binds_nothing.clear()
        names = _names_of_code[code] = tuple(found)
    return names


def _short(value) -> str:
    if value is _UNBOUND:
        return "unbound"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ----------------------------------------------------------------------- what can be an intervention
_checked = weakref.WeakSet()


def check_intervention(fn) -> None:
    """Raise a clear ``TypeError`` unless ``fn`` can be an intervention (an ``async def fn(m)``)."""
    if type(fn) is FunctionType and fn.__code__.co_flags & inspect.CO_COROUTINE:   # an `async def`: the common case
        return
    try:
        if fn in _checked:
            return
    except TypeError:  # unhashable callables are checked every time
        pass
    _check_intervention_once(fn)
    try:
        _checked.add(fn)
    except TypeError:
        pass


def _check_intervention_once(fn) -> None:
    if inspect.iscoroutine(fn):
        raise TypeError(
            f"got a coroutine object {fn!r}; pass the async function itself (e.g. `fn`, not `fn(m)`), "
            "or wrap arguments with functools.partial / a lambda returning a coroutine")
    if not callable(fn):
        raise TypeError(f"an intervention must be an `async def` function taking the model envoy, got {fn!r}")
    if not is_async_fn(fn) and not _returns_coroutine_hint(fn):
        raise TypeError(
            f"{callable_name(fn)} is a plain function; interventions must be `async def` functions taking the model "
            "envoy (`async def fn(m): h = await m.layer.output`)")


def _returns_coroutine_hint(fn) -> bool:
    # functools.partial of an async function, or a lambda returning a coroutine: allowed, checked when called
    if isinstance(fn, functools.partial):
        return is_async_fn(fn.func) or _returns_coroutine_hint(fn.func)
    return getattr(fn, "__name__", "") == "<lambda>"


def split_input(input, fns) -> tuple:
    """``invoke(fn)`` with an intervention and no input means ``invoke(None, fn)``: returns ``(input, fns)``."""
    if not fns and callable(input) and is_async_fn(input):
        return None, (input,)
    return input, fns


def check_kwargs(kwargs) -> None:
    """Keyword arguments go to the model's forward: refuse one that looks like an intervention."""
    for name, v in kwargs.items():
        if inspect.iscoroutine(v) or (callable(v) and is_async_fn(v)):
            raise TypeError(
                f"keyword argument {name}={callable_name(v)} looks like an intervention, but keyword arguments "
                "go to the model's forward; pass interventions positionally: model.trace(x, fn) / "
                "run.invoke(x, fn)")
