"""Whose module calls reach a run's hooks: only the calls of the forward that run is executing.

A run's hooks live in the shared modules' hook dicts, so any call of those
modules reaches them: a module called ad hoc by an intervention, a module
called outside any run (a served session calling a kept envoy on the event
loop's thread), or another run's forward on another thread. Each run records
the thread that runs its forward (:meth:`~asyncinterp.run.Run.start`); its
hooks deliver nothing to a call made on any other thread, nor to a call made
while that thread is inside an ad hoc call (:func:`call_quietly`), whichever
run made it. Several runs sharing one forward (vLLM's live engine) then
still cannot see a module that one of them calls ad hoc.
"""

from __future__ import annotations

from threading import get_ident

__all__ = ["QUIET_THREADS", "call_quietly", "get_ident", "is_quiet"]

#: idents of the threads inside an ad hoc module call: no run's point fires for a call made there
QUIET_THREADS: set = set()


def call_quietly(module, args, kwargs):
    """Call ``module`` so that no run's hook point fires for this call (nor for the calls it makes)."""
    ident = get_ident()
    if ident in QUIET_THREADS:
        return module(*args, **kwargs)
    QUIET_THREADS.add(ident)
    try:
        return module(*args, **kwargs)
    finally:
        QUIET_THREADS.discard(ident)


def is_quiet(thread: int | None) -> bool:
    """Whether a hook of the run executing on ``thread`` must deliver nothing to the call in progress here."""
    ident = get_ident()
    return ident != thread or ident in QUIET_THREADS
