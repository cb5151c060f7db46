"""A dry run: a job sent through the wire and back, checked as a server would, and run on the local model.

``remote="local"``, without a server: :func:`dry_run` writes the job as
bytes (:func:`~.job_wire.dumps_job`, capturing every intervention), reads
it back with every captured source put through the sandbox's static check
(:func:`~.rebuild.checked`), and runs the rebuilt job on ``model``. Whatever
would not travel fails here, on your machine, with the error a server would
give: a value that cannot be captured (``TypeError`` naming it), source the
sandbox refuses (``SandboxRefused`` naming the line). Its results must equal
the plain local run's; if they do not, capture changed the meaning of your
code (please report it).

This checks what travels and what the sandbox's static check refuses; it
runs with Python's own builtins and the real model (not the server's
restricted envoy), so a run-time refusal of the sandbox (an attribute read
or a tensor operation outside the policy) shows only on a server.
"""

from __future__ import annotations

from ...job import Job, Trace
from .job_wire import dumps_job, loads_job
from ..sandbox.rebuild import checked, resolve

__all__ = ["dry_run"]


def dry_run(model, job, compile_source=checked) -> Job:
    """Run ``job`` (a :class:`~asyncinterp.job.Job`, or a ``model.trace()`` being built) as a server would.

    Returns the rebuilt job after its run: ``job.results[i].result`` is invoke ``i``'s result (edits of
    an edited model come first, as in any job). ``compile_source``: see :mod:`.rebuild`.
    """
    if isinstance(job, Trace):
        job = job.job
    if not isinstance(job, Job):
        raise TypeError(f"dry_run takes a Job or a model.trace() being built, got {type(job).__name__}")
    if getattr(compile_source, "envoy", None) is None:   # captured references to the model: this model's modules
        compile_source = _WithModel(compile_source, model)
    back = loads_job(dumps_job(job), compile_source=compile_source)
    engine = model.engine(back.kind)
    carrier = type(engine.make_invoke(0, None, (), {}, False))   # the engine's result carrier (e.g. tokens too)
    back = back.replace(results=tuple(carrier(i, spec) for i, spec in enumerate(back.invokes)))
    engine.start(back).wait()
    return back


class _WithModel:
    """A compile function that also resolves captured references to ``model``'s modules."""

    def __init__(self, compile_source, model):
        self.compile_source = compile_source
        self.model = model

    def __call__(self, source, filename, namespace):
        return self.compile_source(source, filename, namespace)

    def envoy(self, path):
        return resolve(self.model, path)
