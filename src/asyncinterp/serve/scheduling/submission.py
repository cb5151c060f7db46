"""One served job: the single thing every entry point submits, and every front queues, runs and answers.

Every entry of the server becomes one :class:`Submission`, translated once:
the native endpoints, ``/v1/jobs``, sessions' traces, OpenAI completions and
chat (each prompt and each ``n``), named edits and adapters. It holds

* the job as read: its invokes (input, interventions, keyword arguments),
  its kind, its ``on_error`` and its generation options;
* its serving envelope (:class:`Envelope`): the owner's key, the budget
  (the :class:`~.requests.Meter` that the submitted code's clock reports
  to), the deadline, the receipt and the listener (called if it is
  cancelled);
* where it stands: queued, sent (to a worker process), running, done or
  cancelled, and the mailbox through which its events and its answer reach
  the event loop that waits for it.

It goes unchanged to whatever runs it: a :class:`~.batcher.Batcher` queues
it and puts its invokes into a shared run; a worker pool
(:mod:`asyncinterp.serve.workers.pool`) sends its one wire form to a worker
process and tracks it across worker restarts and re-runs.

Inside a run every invoke has its own state (:class:`ServedInvoke`: its
result carrier, the tokens generated for it, the values it emitted). The
submission answers once every invoke has an outcome: the one value of a
single-invoke submission (``single``), or one ``(ok, value)`` per invoke in
invoke order (a remote job). With ``on_error="stop"``, a failure known
while the run goes on (a generation's invoke that ends early) closes the
other invokes at their next hook point.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import NamedTuple

from ... import aio
from .requests import GenerateResult, Meter

log = logging.getLogger("asyncinterp.serve")

__all__ = ["Envelope", "ServedInvoke", "Submission"]


def __getattr__(name):   # old names (Group, Member): the compatibility table, asyncinterp.moved.RENAMED
    from ...moved import old_name
    return old_name(__name__, name)

_ids = itertools.count(1)


class Envelope(NamedTuple):
    """What serving adds to a job: who sent it, what it may spend, until when, and who hears of it.

    ``owner``: the API key's id (``None``: an open server); ``budget``: the
    :class:`~.requests.Meter` that the request's code reports its time to
    (the sandbox's clock; a fresh meter if ``None``); ``deadline``: seconds
    from submission to the answer (``None``: the front's default);
    ``receipt``: the receipt of what computes the answer
    (:mod:`asyncinterp.serve.openai.receipts`), if the entry makes one;
    ``listener``: called (in the waiting event loop) if the submission is
    cancelled or times out.
    """

    owner: object = None
    budget: object = None          # a Meter (or None: a fresh one)
    deadline: float | None = None
    receipt: object = None
    listener: object = None


NO_ENVELOPE = Envelope()


class Submission:
    """One job and its serving envelope, from its entry point to its answer (see the module docs)."""

    __slots__ = ("id", "kind", "invokes", "on_error", "gen", "max_new_tokens", "key", "single", "stream",
                 "envelope", "meter", "arrival", "state", "lock", "mailbox", "finished", "stopping", "outcomes",
                 "on_answer", "events",
                 # where a worker pool runs it (asyncinterp.serve.workers.pool)
                 "fields", "wire", "timeout", "code_budget", "guard", "worker", "suspect", "forwarded", "pool")

    def __init__(self, kind: str, invokes, *, on_error: str = "stop", gen=None, max_new_tokens=None, key=None,
                 single: bool = False, stream: bool = False, envelope: Envelope = NO_ENVELOPE):
        self.id = next(_ids)
        self.kind = kind
        self.on_error = on_error
        self.gen = gen or {}
        self.max_new_tokens = max_new_tokens
        self.key = key
        self.single = single
        self.stream = stream
        self.envelope = envelope
        self.meter = envelope.budget if envelope.budget is not None else Meter()
        self.arrival = time.monotonic()
        self.state = "queued"          # queued -> (sent ->) running -> done | cancelled
        self.lock = threading.Lock()
        self.mailbox = aio.Mailbox()   # made in the submitting task's event loop
        self.finished = False
        self.stopping = False
        self.invokes = [ServedInvoke(self, i, *spec) for i, spec in enumerate(invokes)]
        self.outcomes = [None] * len(self.invokes)
        self.on_answer = None          # see answer()
        self.events = 0                # streamed events put in its mailbox
        self.fields = self.wire = self.worker = self.pool = None
        self.timeout = self.code_budget = 0.0   # seconds: its time limit, its code's compute budget
        self.guard = None
        self.suspect = False           # it was in a batch that a worker died running: it is re-run alone
        self.forwarded = 0             # stream events passed on; a re-run first sends a "restart" event

    @classmethod
    def for_worker(cls, kind: str, fields: dict, *, timeout: float, code_budget: float, guard: float,
                   stream: bool = False, envelope: Envelope = NO_ENVELOPE) -> "Submission":
        """A submission that a worker process runs: ``fields`` is its wire form (a job's bytes, or one
        intervention's request), sent as it is (and once more, marked ``alone``, if it is re-run by itself)."""
        from ...client import wire
        sub = cls(kind, (), single=True, stream=stream, envelope=envelope)
        sub.fields = dict(fields, op="run", id=sub.id, kind=kind, timeout=timeout)
        sub.wire = wire.packb(sub.fields)
        sub.timeout = timeout
        sub.code_budget = code_budget
        sub.guard = time.monotonic() + guard
        return sub

    @property
    def size(self) -> int:
        """How many invokes this submission puts into a batch (it is never split)."""
        return len(self.invokes)

    # worker side -------------------------------------------------------------
    def start(self) -> bool:
        """Queued -> running (``False``: it was cancelled or answered meanwhile)."""
        with self.lock:
            if self.state != "queued" and self.state != "sent":
                return False
            self.state = "running"
            return True

    def reset(self) -> None:
        """Before a front reruns this submission alone (its shared batch failed): forget the failed run."""
        with self.lock:
            self.outcomes = [None] * len(self.invokes)
            self.stopping = False
        for inv in self.invokes:
            inv.reset()

    def collect(self, position: int, ok: bool, value) -> None:
        """An invoke's outcome (the running thread); the submission answers once every invoke has one."""
        with self.lock:
            if self.outcomes[position] is not None:
                return
            self.outcomes[position] = (ok, value)
            complete = all(o is not None for o in self.outcomes)
            stop = not ok and self.on_error == "stop" and not self.stopping and not self.single
            if stop:
                self.stopping = True
        if stop and not complete:
            for inv in self.invokes:
                if inv.position != position and not inv.finished and inv.invoke is not None:
                    inv.invoke.cancel()
        if complete:
            if self.single:
                self.answer(*self.outcomes[0])
            else:
                self.answer(True, list(self.outcomes))

    def answer(self, ok: bool, value) -> None:
        """The whole submission's answer (or failure), once; nothing if it was cancelled.

        ``on_answer(ok, value)``, if set and no event was streamed before it (nothing it could overtake), runs
        first, in the answering thread: a worker process replies from there without a hop back to its event
        loop. The answer reaches the mailbox either way."""
        with self.lock:
            if self.finished:
                return
            self.finished = True
            if self.state == "cancelled":
                return
            self.state = "done"
        if self.on_answer is not None and not self.events:
            self.on_answer(ok, value)
        self.mailbox.put(("done", ok, value))

    def event(self, item) -> None:
        """A streamed event (a token, an emitted value, a restart) for the waiting client."""
        if self.state != "cancelled":
            self.events += 1
            self.mailbox.put(("event", True, item))

    # loop side ---------------------------------------------------------------
    def cancel(self) -> bool:
        """Stop it: it never runs if queued; its invokes close at their next hook point if running.
        ``False``: it had already answered or been cancelled."""
        with self.lock:
            if self.state in ("done", "cancelled"):
                return False
            self.state = "cancelled"
        listener = self.envelope.listener
        if listener is not None:
            try:
                listener()
            except Exception:  # noqa: BLE001 - a callback must not break cancellation
                log.exception("a submission's cancel listener failed")
        for inv in self.invokes:
            if inv.invoke is not None:
                inv.invoke.cancel()
        return True

    def __repr__(self):
        return f"<Submission {self.id} {self.kind} of {len(self.invokes)} invokes ({self.state})>"


class ServedInvoke:
    """One invoke of a :class:`Submission` inside the run that serves it: what its intervention reads and
    sends while it runs (``emit``), the tokens generated for it, and its outcome, which goes to its submission."""

    __slots__ = ("submission", "position", "input", "fns", "kwargs", "gen", "invoke", "tokens", "streamed",
                 "emitted", "finished")

    def __init__(self, submission, position, input, fns=(), kwargs=None, *_):
        self.submission = submission
        self.position = position
        self.input = input
        self.fns = tuple(fns)
        self.kwargs = kwargs or {}
        self.gen = submission.gen          # a generation: replaced by the options with its own seed
        self.invoke = None
        self.tokens = None                 # generation: per row, the ids generated so far
        self.streamed = 0
        self.emitted = []
        self.finished = False

    @property
    def kind(self) -> str:
        return self.submission.kind

    @property
    def max_new_tokens(self):
        return self.submission.max_new_tokens

    @property
    def stream(self) -> bool:
        return self.submission.stream

    @property
    def state(self) -> str:
        return self.submission.state

    def reset(self) -> None:
        self.invoke = None
        self.tokens = None
        self.emitted = []
        self.finished = False
        if self.streamed:
            self.event({"event": "restart"})   # its events so far came from the failed shared run
        self.streamed = 0

    def attach(self, invoke) -> None:
        sub = self.submission
        with sub.lock:
            self.invoke = invoke
            cancelled = sub.state == "cancelled" or sub.stopping
        if cancelled:
            invoke.cancel()

    def deliver(self, ok: bool, value) -> None:
        if self.finished:
            return
        self.finished = True
        self.submission.collect(self.position, ok, value)

    def event(self, item) -> None:
        sub = self.submission
        sub.event(item if sub.single else {**item, "invoke": self.position})

    def finish(self, model) -> None:
        """Deliver the outcome of this invoke once its run has it (a value, or a generation's result)."""
        if self.submission.kind == "generate":
            self.finish_generation(model.tokenizer)
            return
        try:
            value = self.invoke.result
        except BaseException as exc:  # noqa: BLE001
            self.deliver(False, exc)
        else:
            self.deliver(True, value)

    def finish_generation(self, tokenizer, early=False) -> None:
        """Deliver this invoke's generation: its value, tokens and text (``early``: it left the run)."""
        if self.finished:
            return
        try:
            value = self.invoke.value() if early else self.invoke.result
        except BaseException as exc:  # noqa: BLE001
            self.deliver(False, exc)
            return
        rows = self.tokens or [[]]
        texts = [tokenizer.decode(row, skip_special_tokens=True) for row in rows]
        self.stream_tokens(tokenizer, final=True)
        single = len(rows) == 1
        lps = _logprobs(self.invoke, "logprobs") if self.gen.get("logprobs") is not None else None
        self.deliver(True, GenerateResult(value, rows[0] if single else rows, texts[0] if single else texts,
                                          list(self.emitted), getattr(self.invoke, "cached_tokens", None),
                                          None if lps is None else list(lps[:len(rows[0])]),
                                          _logprobs(self.invoke, "prompt_logprobs")
                                          if self.gen.get("prompt_logprobs") is not None else None))

    def stream_tokens(self, tokenizer, final=False) -> None:
        """A streaming submission: send a ``token`` event for each token generated since the last call."""
        if not self.submission.stream or self.tokens is None or len(self.tokens) != 1:
            return
        row = self.tokens[0]
        while self.streamed < len(row):
            i = self.streamed
            prev = tokenizer.decode(row[:i], skip_special_tokens=True)
            now = tokenizer.decode(row[:i + 1], skip_special_tokens=True)
            item = {"event": "token", "step": i, "token": row[i], "text": now[len(prev):]}
            if self.gen.get("logprobs") is not None:
                item["logprobs"] = _logprob_at(self.invoke, i)
                if i == 0 and self.gen.get("prompt_logprobs") is not None:
                    item["prompt_logprobs"] = _logprobs(self.invoke, "prompt_logprobs")
            self.event(item)
            self.streamed += 1


def _logprobs(invoke, name):
    """An invoke's ``logprobs``/``prompt_logprobs`` (both engines' invokes have them), or ``None``."""
    try:
        return getattr(invoke, name, None)
    except Exception:  # noqa: BLE001 - an invoke whose run has gone: nothing to report
        return None


def _logprob_at(invoke, i):
    at = getattr(invoke, "logprob_at", None)
    return None if at is None else at(i)
