"""Streaming one vLLM request: a live job's tokens and emitted values as events, while it runs.

``VLLM.astream`` gives its job a :class:`StreamListener`; the engine loop's
thread calls it as the request produces tokens and its interventions emit
values, and it puts ``{"event": "token" | "emit", ...}`` items into a
:class:`~asyncinterp.aio.Mailbox` that the caller's event loop reads
(``None`` when the job is done). Serving has its own listener
(``serve.batcher``); this one is for a plain ``async for``.
"""

from __future__ import annotations

__all__ = ["StreamListener"]


class StreamListener:
    """Turns a live job's outputs into stream events in a :class:`~asyncinterp.aio.Mailbox` (``None`` ends it)."""

    def __init__(self, box, tokenizer):
        self.box = box
        self.tokenizer = tokenizer
        self.sent = {}

    def on_output(self, invoke) -> None:
        ids = invoke.token_ids
        i = self.sent.get(invoke.index, 0)
        while i < len(ids):
            before = self.tokenizer.decode(ids[:i], skip_special_tokens=True)
            now = self.tokenizer.decode(ids[:i + 1], skip_special_tokens=True)
            self.box.put({"event": "token", "step": i, "token": ids[i], "text": now[len(before):]})
            i += 1
        self.sent[invoke.index] = i

    def on_event(self, index, item) -> None:
        self.box.put(item)

    def on_finish(self, job) -> None:
        self.box.put(None)
