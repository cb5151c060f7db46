"""Serving: many concurrent requests, each with its own intervention, coalesced into shared forward passes.

* :class:`Batcher` — in process: ``await batcher.trace(prompt, fn)`` from many
  tasks; requests that arrive together run as invokes of one forward. It is
  an engine: ``batcher.start(job, Envelope(...))`` takes a whole job and
  returns its :class:`Submission` (the one unit of serving).
* :class:`Server` — the Starlette app (``server.app``) with named, typed
  interventions (``@server.intervention("steer")``) and, behind a flag,
  client-submitted source run in a restricted sandbox.
* :class:`Client` — sync and async HTTP client mirroring local ``trace``.
* :mod:`.wire` — the msgpack wire format (tensors as dtype/shape/bytes).
* :func:`dry_run` — a job through the wire and back, run on the local model
  (what a server would refuse shows here; see docs/remote.md).

See docs/serving.md.

Every name here is imported on first use: ``ai.remote`` and the clients live
in this package (:mod:`.remote`, :mod:`.client`, the job's writing side
:mod:`.job_form`, :mod:`.wire`) and must load no server module (the batcher,
the app, the sandbox), nor need the server's dependencies.
"""

from ..client.wire import RemoteError, WireError

_BATCHER = ("Batcher", "BatcherClosed", "BatcherFull", "GenerateResult", "emit")


def __getattr__(name):
    if name in _BATCHER:
        from .scheduling import batcher
        return getattr(batcher, name)
    # the HTTP parts need starlette/httpx (the `serve` extra): imported on first use
    if name in ("Submission", "Envelope"):
        from .scheduling import submission
        return getattr(submission, name)
    if name in ("Param", "Range", "MaxLen", "ModulePath"):
        from .scheduling import params
        return getattr(params, name)
    if name in ("Server", "serve_app"):
        from .http import app
        return getattr(app, name)
    if name == "dry_run":
        from .jobs.dryrun import dry_run
        return dry_run
    if name in ("Client", "AsyncClient"):
        from ..client import clients as client
        return getattr(client, name)
    raise AttributeError(f"module 'asyncinterp.serve' has no attribute {name!r}")


__all__ = ["AsyncClient", "Batcher", "BatcherClosed", "BatcherFull", "Client", "Envelope", "GenerateResult", "MaxLen",
           "ModulePath", "Param", "Range", "RemoteError", "Server", "Submission", "WireError",
           "dry_run", "emit"]
