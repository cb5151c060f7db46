"""A job as bytes and back: what the wire carries when a whole job travels.

A :class:`~asyncinterp.job.Job` is a plain value; :mod:`.job_form` writes it as
msgpack (through :mod:`.wire`, so tensors are ``(dtype, shape, bytes)`` and
nothing is pickled) and reads it back. Interventions travel as source text,
never bytecode, so client and server Python versions may differ: all of a
job's interventions are captured together (:mod:`.capture`: their source,
the values, helpers, modules and futures they read; what two invokes share
is shared after the trip). Reading a job back never executes anything by
itself: the caller passes ``compile_source`` (see :mod:`.rebuild`: on a
server, the sandbox's), through which every captured source is compiled.
``named(spec)`` binds an intervention registered on the server
(:class:`Named`, ``{"name", "params"}``). The older ``compile(spec)`` (one self-contained intervention's
``{"source", "entry", "params"}`` to a callable) still works when no
``compile_source`` is given; it refuses what a closure or global needs.

What travels: every invoke's input, keyword arguments, per-invoke options,
``background`` flag and interventions; the job's kind, ``on_error``,
``stop_per_invoke``, generation options and context. What does not: the
result carriers and the listener (where results go is decided on the side
that runs the job) and an invoke's late-binding snapshot (a check made on
the side that built it). A value that cannot travel is a ``TypeError``
naming where it sits in the job.

This module reads a job (the server's side, with :mod:`.rebuild`);
writing it is :mod:`.job_form`'s (the client's side, which loads no server
module), whose names are importable from here too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from ...invoke import Invoke
from ...job import InvokeSpec, Job, frozen_mapping
from ...client import wire
from ...client.cache_wire import build_cache
# the writing side is the client's (it loads no server code); its names stay importable from here
from ...client.job_form import JOB_FORMAT, Named, dumps_job  # noqa: F401
from ..sandbox.rebuild import DescriptionRefused, intervention, rebuild

__all__ = ["JOB_FORMAT", "JobOutline", "JobParts", "Named", "dumps_job", "loads_job", "outline_job", "read_job",
           "served_job"]


class JobParts(NamedTuple):
    """A job as read from the wire, before it runs: what a server checks and hands to its front, where it
    becomes (part of) the one :class:`~asyncinterp.job.Job` that runs. The fields are the job's own."""

    invokes: tuple
    kind: str
    on_error: str
    stop_per_invoke: bool
    generation: Mapping
    context: Mapping


class JobOutline(NamedTuple):
    """What a process that passes a job on (a supervised server) reads of it, compiling nothing: its kind, its
    invokes, its generation options and whether it carries submitted code (captured functions, which only the
    worker for submitted code may read)."""

    kind: str
    invokes: int
    generation: Mapping
    code: bool


def loads_job(data: bytes, compile=None, limits: wire.Limits = wire.DEFAULT_LIMITS, *,
              compile_source=None, named=None) -> Job:
    """The job that :func:`dumps_job` wrote, its interventions rebuilt with ``compile_source`` (see :mod:`.rebuild`).

    Without ``compile_source``, ``compile(spec)`` turns each intervention's self-contained form
    (``{"source", "entry", "params"}``) into a callable, as before captures. Each invoke gets a fresh
    result carrier (:class:`~asyncinterp.invoke.Invoke`).
    """
    parts = read_job(data, compile, limits, compile_source=compile_source, named=named)
    carriers = tuple(Invoke(i, spec) for i, spec in enumerate(parts.invokes))
    try:
        return Job(*parts, carriers)
    except ValueError as exc:
        raise wire.WireError(str(exc)) from None


def served_job(kind: str, input, fns, generation=None) -> bytes:
    """One served request as a job in the wire form, its interventions as the server checked them: a registered
    one's ``{"name", "params"}``, submitted code's self-contained ``{"source", "entry", "params"}``, a named
    edit's ``{"edit": name}``. What a supervised server sends a worker process for a native or OpenAI request
    (a remote job travels as its client wrote it); :func:`read_job` reads both."""
    return wire.packb({"format": JOB_FORMAT, "kind": kind, "on_error": "stop", "stop_per_invoke": False,
                       "generation": dict(generation or {}), "context": {}, "capture": None,
                       "invokes": [{"input": input, "fns": list(fns), "kwargs": {}, "options": {}, "background": False}]})


def read_job(data: bytes, compile=None, limits: wire.Limits = wire.DEFAULT_LIMITS, *,
             compile_source=None, named=None, edit=None) -> JobParts:
    """What :func:`loads_job` reads, without making a :class:`~asyncinterp.job.Job` of it: a server hands the parts
    to its front, which runs them in the one job of their batch (one ``Job`` per process, issue 30).
    ``edit(name)``: the function of a named edit (``{"edit": name}``, see :func:`served_job`)."""
    body = _body(data, limits)
    if compile_source is not None:
        description = body.get("capture")
        built = rebuild(description, compile_source)

        entry = getattr(compile_source, "entry", None)   # e.g. the sandbox's restricted view of the model

        def compile(spec):   # noqa: A001 - the same role as the argument it stands for
            fn = intervention(built, spec, description)
            return fn if entry is None else entry(fn)
    elif compile is None:
        raise TypeError("loads_job needs compile_source (see asyncinterp.serve.sandbox.rebuild) or compile")
    else:
        compile = _self_contained(compile)
    if named is not None:
        compile = _or_named(compile, named)
    if edit is not None:
        compile = _or_edit(compile, edit)
    compile = _or_cache(compile)
    specs = []
    for i, item in enumerate(_list(body, "invokes")):
        if not isinstance(item, dict):
            raise wire.WireError(f"invoke {i} of the job is not a map")
        fns = tuple(compile(fn) for fn in _list(item, "fns"))
        specs.append(InvokeSpec(item.get("input"), fns, frozen_mapping(_map(item, "kwargs")),
                                frozen_mapping(_map(item, "options")), (), bool(item.get("background"))))
    kind, on_error = _kind(body)
    return JobParts(tuple(specs), kind, on_error, bool(body.get("stop_per_invoke")),
                    frozen_mapping(_map(body, "generation")), frozen_mapping(_map(body, "context")))


def outline_job(data: bytes, limits: wire.Limits = wire.DEFAULT_LIMITS) -> JobOutline:
    """The job's :class:`JobOutline`, read without compiling or checking any of its code: what a supervised
    server needs to route a job to the worker that reads it whole (:func:`read_job`, once, where it runs)."""
    body = _body(data, limits)
    capture = body.get("capture")
    code = capture is not None and (not isinstance(capture, dict) or bool(capture.get("functions")))
    invokes = _list(body, "invokes")
    for i, item in enumerate(invokes):
        if not isinstance(item, dict):
            raise wire.WireError(f"invoke {i} of the job is not a map")
        code = code or not all(_trusted_form(spec) for spec in _list(item, "fns"))
    kind, _ = _kind(body)
    return JobOutline(kind, len(invokes), frozen_mapping(_map(body, "generation")), code)


def _body(data: bytes, limits: wire.Limits) -> dict:
    body = wire.unpackb(data, limits)
    if not isinstance(body, dict) or body.get("format") != JOB_FORMAT:
        found = body.get("format") if isinstance(body, dict) else type(body).__name__
        raise wire.WireError(f"not a job of wire format {JOB_FORMAT} (found {found!r})")
    return body


def _kind(body: dict) -> tuple:
    kind, on_error = body.get("kind", "trace"), body.get("on_error", "stop")
    if kind not in ("trace", "generate") or on_error not in ("stop", "continue"):
        raise wire.WireError(f"a job's kind is 'trace' or 'generate' and its on_error 'stop' or 'continue', got "
                             f"{str(kind)[:40]!r} and {str(on_error)[:40]!r}")
    return kind, on_error


def _trusted_form(spec) -> bool:
    """Whether an intervention's wire form is one the server binds to its own code: a registered intervention
    (``{"name", "params"}``) or an activation cache's options (``{"cache": ...}``), never a captured function."""
    return _form(spec, "name") or _form(spec, "cache")


def _form(spec, key: str) -> bool:
    """Whether ``spec`` is the wire form named by ``key`` (``name``, ``cache``, ``edit``), not a captured function."""
    return isinstance(spec, dict) and key in spec and "function" not in spec


def _or_cache(compile):
    """An activation cache (``{"cache": options}``) is built here, as trusted code (see :mod:`.cache_wire`)."""
    def compile_or_cache(spec):
        if _form(spec, "cache"):
            return build_cache(spec["cache"])
        return compile(spec)
    return compile_or_cache


def _or_edit(compile, edit):
    """``edit(name)`` for a named edit (``{"edit": name}``), ``compile(spec)`` for the rest."""
    def compile_or_edit(spec):
        if _form(spec, "edit"):
            return edit(spec["edit"])
        return compile(spec)
    return compile_or_edit


def _or_named(compile, named):
    """``named(spec)`` for a registered intervention (``{"name", "params"}``), ``compile(spec)`` for the rest."""
    def compile_or_bind(spec):
        if _form(spec, "name"):
            return named(spec)
        return compile(spec)
    return compile_or_bind


def _self_contained(compile):
    def compile_plain(spec):
        if not isinstance(spec, dict) or "source" not in spec:
            raise DescriptionRefused("this job's interventions read closure variables or globals: read it with "
                                     "loads_job(data, compile_source=...) (see asyncinterp.serve.sandbox.rebuild)")
        return compile(spec)
    return compile_plain


def _list(obj, key) -> list:
    value = obj.get(key) or []
    if not isinstance(value, (list, tuple)):
        raise wire.WireError(f"{key!r} of a job must be a list")
    return list(value)


def _map(obj, key) -> dict:
    value = obj.get(key) or {}
    if not isinstance(value, dict):
        raise wire.WireError(f"{key!r} of a job must be a map")
    return value
