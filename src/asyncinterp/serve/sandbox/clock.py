"""A request's clock: the compute budget, the deadline and cancellation, checked by the tick.

Submitted code calls the tick at every loop iteration, call, lambda and
comprehension step (see :mod:`.instrumentation`); :class:`Clock` raises
:class:`~.errors.SandboxTimeout` there once the request's time is up, so a
runaway loop ends that request only, where it runs.
"""

from __future__ import annotations

import time

from ..scheduling.batcher import Meter
from ...client import policy
from .errors import SandboxTimeout


class Clock(Meter):
    """Per-request limits the tick checks: compute budget, deadline, cancellation.

    ``budget``: CPU seconds the request's submitted code may run in all,
    counted only while one of its tasks is resumed (:class:`~.driver.Driven`
    times every resumption, in every hook firing and generation step; waiting
    for the model or for other requests costs nothing). ``deadline``: the
    request's wall-clock limit (``time.monotonic()``), extended by its
    credit (:meth:`Meter.credit`: time other requests' code held the worker
    meanwhile). Past either, the next tick raises :class:`SandboxTimeout`
    there, and every tick after it.
    """

    __slots__ = ("deadline", "budget", "cancelled", "reason", "count", "grad")

    def __init__(self, deadline=None, budget=None):
        super().__init__()
        self.deadline = deadline
        self.budget = budget
        self.cancelled = False
        self.reason = "the request was cancelled"
        self.count = 0
        self.grad = False       # a gradient request: its private copies stay on the autograd graph

    def tick(self):
        self.count += 1
        if self.cancelled:
            raise SandboxTimeout(self.reason)
        if self.count % policy.TICKS_PER_CLOCK_CHECK == 0:
            self.check()
        return True

    def check(self):
        budget = self.budget
        if budget is not None and self.depth:
            used = self.cpu_now()
            if used > budget:
                self.stop(f"submitted code used up its compute budget of {budget:g} s (CPU time while its code "
                          f"ran in hook firings: {used:.3f} s) and was stopped here; the forward went on for "
                          "the other requests")
        deadline = self.deadline
        if deadline is not None and time.monotonic() > deadline and time.monotonic() > deadline + self.credit():
            self.stop("the request's time limit was reached while submitted code was running")

    def stop(self, reason):
        self.cancelled = True
        self.reason = reason
        raise SandboxTimeout(reason)
