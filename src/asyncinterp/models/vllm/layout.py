"""Views on vLLM's flat token layout: each invoke sees its own request's tokens, re-read every engine step.

vLLM does not batch requests as padded rows. At every engine step the model
runs on one flat ``[tokens, ...]`` dimension: the scheduled tokens of all
running requests back to back, in the order of the model runner's persistent
batch (``input_batch.req_ids``), request ``i`` owning rows
``query_start_loc[i]:query_start_loc[i+1]``. That order changes from step to
step (finished requests leave and the last one moves into the hole, new ones
join), a step mixes prompt tokens (prefill, possibly a chunk of a long prompt)
with one token per decoding request, and a request may sit a step out.

:class:`FlatLayout` is re-filled by the run at the start of every engine step
(``set_step``) from the runner's own bookkeeping, so it is never stale. It
gives each invoke a real view (basic slicing, so in-place edits reach the
engine) of its request's rows, with a leading batch dimension of one, the way
a transformers model shows a batch of one prompt: a layer output ``[T, H]``
becomes ``[1, n, H]`` for a request with ``n`` tokens in this step, so
``h[:, -1]`` is the request's last token in both. Tensors whose first
dimension is not the token dimension (weights, scalars) are given whole.

After the forward, the logits processor and the sampler work on one row per
request (``[R, vocab]`` logits, ``[R, 1]`` sampled ids). Those points use
the layout in *request mode* (``per_request=True``): an invoke sees row
``i`` of its request as ``[1, ...]`` (no extra dimension added: ``[1, vocab]``
logits, like ``m.logits`` of a language model).

An invoke without input (no request of its own) sees the raw flat value of
every request, ``[T, H]``.
"""

from __future__ import annotations

import dataclasses

import torch

from ...hooks.views import BatchLayout


class FlatLayout(BatchLayout):
    """Per-invoke views of the flat ``[tokens, ...]`` (or per-request ``[requests, ...]``) values of one step.

    Writing replacements back into the full value is :class:`BatchLayout`'s
    (through :meth:`index`, this step's rows of a group); only dataclasses
    (vLLM's ``SamplerOutput``) are added here.
    """

    def __init__(self, per_request: bool = False):
        # not BatchLayout.__init__: the spans are re-set at every engine step (set_step)
        self.spans = {}          # invoke group -> (start, stop, row) in this step
        self.tokens = 0          # T: scheduled tokens in this step
        self.rows = 0            # R: requests in this step
        self.per_request = per_request
        self.batch_size = 0

    def set_step(self, spans: dict, tokens: int, rows: int) -> None:
        """A new engine step: ``spans[group] = (start, stop, row)`` for every request scheduled in it."""
        self.spans = spans
        self.tokens = int(tokens)
        self.rows = int(rows)
        self.batch_size = self.rows if self.per_request else self.tokens

    def request_mode(self) -> "FlatLayout":
        """The same step seen one row per request (logits, sampled ids)."""
        other = FlatLayout(per_request=True)
        other.set_step(self.spans, self.tokens, self.rows)
        return other

    # ------------------------------------------------------------------ Layout
    def covers_all(self, group) -> bool:
        """Only an invoke without a request sees the value as the engine holds it.

        A request's view has a leading dimension of one that the flat value has
        not (``[1, n, H]`` of ``[T, H]``), even when it is the only request:
        a value shaped like the view cannot stand for the whole flat value, so
        a skip or a shape-changing replacement must go through :meth:`merge`.
        """
        span = self.spans.get(group)
        if span is None:
            return True
        return self.per_request and self.rows == 1

    def index(self, tensor: torch.Tensor, group):
        """The rows of ``group`` in full tensor ``tensor`` this step, or ``None`` if ``tensor`` is not batched."""
        span = self.spans[group]
        if tensor.dim() == 0:
            return None
        if self.per_request:
            return slice(span[2], span[2] + 1) if tensor.shape[0] == self.rows else None
        return slice(span[0], span[1]) if tensor.shape[0] == self.tokens else None

    def view(self, value, group):
        span = self.spans.get(group)
        if span is None:
            return value
        return self._map(value, span)

    def merge(self, value, replaced: dict):
        whole = [g for g in replaced if g not in self.spans]
        parts = [(g, replaced[g]) for g in replaced if g in self.spans]
        out = replaced[whole[-1]] if whole else value
        if not parts:
            return out
        return self._write_rows(out, parts)

    # ---------------------------------------------------------------- internals
    def _cut(self, t, span):
        if t.dim() == 0:
            return t
        if self.per_request:
            if t.shape[0] != self.rows:
                return t
            return t[span[2]:span[2] + 1]
        if t.shape[0] != self.tokens:
            return t
        return t[span[0]:span[1]].unsqueeze(0)

    def _map(self, value, span):
        if isinstance(value, torch.Tensor):
            return self._cut(value, span)
        if isinstance(value, tuple):
            items = [self._map(v, span) for v in value]
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        if isinstance(value, list):
            return [self._map(v, span) for v in value]
        if isinstance(value, dict):
            return {k: self._map(v, span) for k, v in value.items()}
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return replace_fields(value, {f.name: self._map(getattr(value, f.name), span)
                                          for f in dataclasses.fields(value)})
        return value

    def _write_rows(self, value, parts):
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return replace_fields(value, {
                f.name: self._write_rows(getattr(value, f.name), [(g, getattr(new, f.name)) for g, new in parts])
                for f in dataclasses.fields(value)})
        # tensors, tuples, lists, dicts: BatchLayout's, with this step's rows (index); a view's leading
        # dimension of one is dropped and its dtype converted by the assignment into the full tensor
        return super()._write_rows(value, parts)

    def __repr__(self):
        mode = "requests" if self.per_request else "tokens"
        return f"FlatLayout({mode}, tokens={self.tokens}, rows={self.rows}, spans={self.spans})"


def replace_fields(obj, fields: dict):
    """A copy of dataclass ``obj`` with ``fields`` (init fields only; others are copied as they are)."""
    init = {f.name: fields[f.name] for f in dataclasses.fields(obj) if f.init}
    new = type(obj)(**init)
    for f in dataclasses.fields(obj):
        if not f.init:
            object.__setattr__(new, f.name, fields[f.name])
    return new
