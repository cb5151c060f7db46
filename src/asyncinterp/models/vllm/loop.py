"""The live engine: one thread per ``ai.VLLM`` engine steps it, and runs join and leave between any two steps.

Why a loop of our own over the in-process engine (and not vLLM's ``AsyncLLM``):
asyncinterp's hooks must run in the process and thread that runs the model's
forward, between the engine's scheduling and sampling, and every run needs
its worker side opened (tasks started, hooks installed) *before* the step
that first schedules its requests and closed right after the step that
finishes them. ``AsyncLLM`` runs the engine core in a background process or
its own busy loop and offers no "between two steps" point to do that; with
``LLMEngine.step()`` in our own loop each of those points is just a line of
code. The loop is the only caller of ``engine.step()``.

A *job* is a :class:`~.jobs.LiveJob` (one or more invokes, each a vLLM
request). The loop, between two steps:

1. admits the jobs submitted meanwhile (adds their requests, opens their
   worker runs: their tasks run to their first ``await``);
2. applies cancellations (aborts the requests in the engine alone);
3. runs one engine step, hands each request's new tokens to its job (which
   streams them to whoever listens) and asks the worker runs what happened
   (a task stopped its request, a failure halted a run);
4. closes every job whose requests have all finished: its results are
   delivered at once, whatever the other jobs are doing.

Plain jobs (no intervention) open no worker run at all: they cost what a
request on vLLM's own server costs.
"""

from __future__ import annotations

import itertools
import logging
import threading

from .environment import adopt_torch_threads

log = logging.getLogger("asyncinterp.vllm")

_keys = itertools.count(1)


class EngineClosed(RuntimeError):
    """The engine was closed; no run can join it any more."""


class EngineLoop:
    """Steps one vLLM engine in a thread of its own while any job is live; idle otherwise."""

    def __init__(self, model):
        self.model = model
        self.engine = model.llm_engine
        self.cond = threading.Condition()
        self.inbox = []              # jobs submitted, not admitted yet
        self.jobs = []               # admitted, unfinished jobs, in admission order
        self.thread = None
        self.closed = False
        self.steps = 0               # engine steps run by this loop

    # ------------------------------------------------------------ any thread
    def submit(self, job) -> None:
        """Queue ``job`` to join the engine before its next step (returns at once)."""
        with self.cond:
            if self.closed:
                raise EngineClosed("this VLLM model was closed")
            job.key = f"ai{next(_keys)}"
            self.inbox.append(job)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="asyncinterp-vllm-engine", daemon=True)
                self.thread.start()
            self.cond.notify_all()

    def wake(self) -> None:
        """Something changed (a cancellation): look at it before the next step."""
        with self.cond:
            self.cond.notify_all()

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self.thread

    def close(self, timeout: float = 30.0) -> None:
        """Cancel every job, stop the thread (after its current step)."""
        with self.cond:
            self.closed = True
            waiting = list(self.inbox)
            self.inbox.clear()
            for job in self.jobs:
                job.cancelled = True
            self.cond.notify_all()
        for job in waiting:
            job.fail_before_admission(EngineClosed("the VLLM model was closed before this run could start"))
        t = self.thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    # ------------------------------------------------------------ the loop thread
    def _run(self) -> None:
        adopt_torch_threads()
        cond = self.cond
        while True:
            with cond:
                while not self.inbox and not self.jobs and not self.closed:
                    cond.wait()
                if self.closed and not self.jobs and not self.inbox:
                    self.thread = None
                    return
                new, self.inbox = self.inbox, []
            self._admit(new)
            new = None       # a finished job must not stay alive in this frame while the loop waits
            try:
                self._step()
            except BaseException as exc:  # noqa: BLE001 - the loop must survive for the next jobs
                log.exception("vLLM engine step failed; failing the runs in it")
                for job in self.jobs:
                    job.fail(exc)
                self._close_finished()

    def _admit(self, new) -> None:
        for job in new:
            if job.admit(self):
                self.jobs.append(job)

    def _step(self) -> None:
        engine = self.engine
        for job in self.jobs:
            job.before_step(engine)
        self._close_finished()
        if not self.jobs:
            return
        outs = engine.step()
        self.steps += 1
        owner = {}
        for job in self.jobs:
            for rid in job.pending:
                owner[rid] = job
        mine = {id(job): [] for job in self.jobs}
        for out in outs:
            job = owner.get(out.request_id)
            if job is not None:
                mine[id(job)].append(out)
        polled = self.model.poll([job.key for job in self.jobs if job.opened])
        idle = not engine.has_unfinished_requests()
        for job in self.jobs:
            try:
                job.after_step(engine, mine[id(job)], polled.get(job.key), idle)
            except BaseException as exc:  # noqa: BLE001 - this job fails alone
                job.fail(exc)
        self._close_finished()

    def _close_finished(self) -> None:
        if not any(job.finished_requests() for job in self.jobs):
            return
        keep = []
        for job in self.jobs:
            if job.finished_requests():
                job.close()
            else:
                keep.append(job)
        self.jobs = keep
