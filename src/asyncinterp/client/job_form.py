"""A job written as bytes: the client's half of the job wire format (:mod:`.job_wire` reads it back).

Why a module of its own: ``ai.remote`` writes jobs and must load no server
code; reading a job back rebuilds its interventions (:mod:`.rebuild`, the
sandbox's checker), which is the server's business. This module imports
only the job, the capture of functions (:mod:`.capture`), the cache's
options (:mod:`.cache_wire`) and the msgpack format (:mod:`.wire`). What
travels is described in :mod:`.job_wire`.
"""

from __future__ import annotations

from ..job import Job
from ..tools.cache import Cache
from . import wire
from .cache_wire import describe_cache
from .capture import Capture
from .clients import intervention_spec

__all__ = ["JOB_FORMAT", "Named", "dumps_job"]

#: the version of a job's wire form; a reader refuses any other
JOB_FORMAT = 2


class Named:
    """An intervention registered on the server, by name (``remote.registered("top_k", k=5)``): it travels
    as ``{"name", "params"}`` and the server binds its own function (trusted code, no capture)."""

    def __init__(self, name: str, params: dict | None = None):
        if not isinstance(name, str) or not name:
            raise TypeError(f"a registered intervention's name is a non-empty string, got {name!r}")
        self.name = name
        self.params = dict(params or {})
        self.__qualname__ = self.__name__ = name

    async def __call__(self, m):
        raise RuntimeError(f"{self.name!r} is an intervention registered on a server: it runs only there "
                           "(through ai.remote)")

    def __repr__(self):
        return f"<registered intervention {self.name!r} {self.params}>"


def dumps_job(job: Job) -> bytes:
    """The job as msgpack bytes (see the module docs for what travels)."""
    invokes = []
    capture = Capture()
    for i, spec in enumerate(job.invokes):
        fns = []
        for fn in spec.fns:
            if isinstance(fn, Named):
                fns.append({"name": fn.name, "params": fn.params})
                continue
            if isinstance(fn, Cache):   # an activation cache: its options (see cache_wire)
                fns.append({"cache": describe_cache(fn)})
                continue
            try:
                fns.append({**_plain_form(fn), **capture.add_intervention(fn)})
            except TypeError as exc:
                raise TypeError(f"invoke {i} of the job: {exc}") from None
        invokes.append({"input": spec.input, "fns": fns, "kwargs": dict(spec.kwargs),
                        "options": dict(spec.options), "background": spec.background})
    body = {"format": JOB_FORMAT, "kind": job.kind, "on_error": job.on_error,
            "stop_per_invoke": job.stop_per_invoke, "generation": dict(job.generation),
            "context": dict(job.context), "invokes": invokes,
            "capture": capture.description()}
    try:
        return wire.packb(body)
    except (TypeError, wire.WireError) as exc:
        raise TypeError(f"this job cannot travel: {exc}. Inputs, options and context must be tensors, numbers, "
                        "strings, bytes, None, or lists, tuples and dicts of these") from None


def _plain_form(fn) -> dict:
    """The self-contained form of ``fn`` for an older ``compile(spec)`` (empty when it reads captured names)."""
    try:
        return intervention_spec(fn)
    except TypeError:
        return {}
