"""Views: what a task sees of a batched value, and how its writes go back.

A hook point fires once for the whole batch. Each invoke owns some rows of
it; a :class:`Layout` turns the full value into that invoke's view (a real
tensor view, so in-place edits reach the model) and merges the replacements
of all invokes back into one value before the model continues.

Every model-specific batching rule (padding-aware language-model batches,
vLLM's flat token layout, tensor-parallel shards) is a Layout subclass; the
rest of the library only calls ``view`` and ``merge``.
"""

from __future__ import annotations

import torch

from ..kernel.errors import ReplacementError


def map_tensors(fn, value):
    """Apply ``fn`` to every tensor inside nested tuples/lists/dicts."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        items = [map_tensors(fn, v) for v in value]
        if hasattr(value, "_fields"):  # namedtuple
            return type(value)(*items)
        return tuple(items)
    if isinstance(value, list):
        return [map_tensors(fn, v) for v in value]
    if isinstance(value, dict):
        return type(value)((k, map_tensors(fn, v)) for k, v in value.items()) if type(value) is dict \
            else _rebuild_mapping(value, {k: map_tensors(fn, v) for k, v in value.items()})
    return value


def _rebuild_mapping(original, items):
    try:
        return type(original)(**items)
    except TypeError:
        return dict(items)


class Layout:
    """The whole batch belongs to every invoke (a single input, or an invoke without input)."""

    batch_size = None

    def view(self, value, group):
        return value

    def merge(self, value, replaced: dict):
        """Combine ``{group: new_view}`` into a new full value (or ``None`` for no change)."""
        new = None
        for _, v in replaced.items():
            new = v
        return new

    def covers_all(self, group) -> bool:
        return True


#: the layout of a run without batching (one input, or every invoke sees the whole batch); stateless, shared
WHOLE_BATCH = Layout()


class BatchLayout(Layout):
    """Invokes own consecutive rows of dim 0; ``spans[g]`` is ``None`` for whole-batch invokes."""

    def __init__(self, spans, batch_size: int):
        self.spans = [None if s is None else slice(int(s[0]), int(s[1])) for s in spans]
        self.batch_size = batch_size

    def covers_all(self, group) -> bool:
        span = self.spans[group]
        return span is None or (span.start == 0 and span.stop == self.batch_size)

    def index(self, tensor: torch.Tensor, group):
        """The index selecting ``group``'s part of ``tensor``, or ``None`` if the tensor is not batched."""
        span = self.spans[group]
        if span is None or tensor.dim() == 0 or tensor.shape[0] != self.batch_size:
            return None
        return span

    def view(self, value, group):
        span = self.spans[group]
        if span is None:
            return value
        if type(value) is torch.Tensor:   # index() inline: this runs for every invoke at every firing
            if value.dim() == 0 or value.shape[0] != self.batch_size:
                return value
            return value[span]

        def cut(t):
            idx = self.index(t, group)
            return t if idx is None else t[idx]
        return map_tensors(cut, value)

    def merge(self, value, replaced: dict):
        whole = [g for g in replaced if self.spans[g] is None]
        parts = [g for g in replaced if self.spans[g] is not None]
        out = replaced[whole[-1]] if whole else value
        if not parts:
            return out
        return self._write_rows(out, [(g, replaced[g]) for g in parts])

    def _write_rows(self, value, parts):
        if isinstance(value, torch.Tensor):
            out = None
            for g, new in parts:
                if not isinstance(new, torch.Tensor):
                    continue
                idx = self.index(value, g)
                if idx is None:
                    out = new  # unbatched tensor: the replacement applies as a whole
                    continue
                if out is None:
                    out = value.clone()
                out[idx] = new
            return value if out is None else out
        if isinstance(value, (tuple, list)):
            items = [self._write_rows(v, [(g, new[i]) for g, new in parts]) for i, v in enumerate(value)]
            if isinstance(value, list):
                return items
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        if isinstance(value, dict):
            items = {k: self._write_rows(v, [(g, new[k]) for g, new in parts]) for k, v in value.items()}
            return items if type(value) is dict else _rebuild_mapping(value, items)
        # plain values: last writer wins
        return parts[-1][1] if parts else value


def check_replacement(point_name: str, new, old, path: str = "", shape_change: bool = False,
                      dtype_change: bool = False) -> None:
    """Raise :class:`ReplacementError` unless ``new`` has the structure, shapes, dtypes and devices of ``old``.

    ``shape_change=True`` / ``dtype_change=True`` (explicit opt-ins) accept
    tensors of another shape / dtype.
    """
    where = f"{point_name}{path}"
    if isinstance(old, torch.Tensor):
        if not isinstance(new, torch.Tensor):
            raise ReplacementError(
                f"replacement for {where} must be a tensor of shape {tuple(old.shape)}, got {type(new).__name__}")
        if new.device != old.device:
            raise ReplacementError(
                f"replacement for {where} is on {new.device} but the value it replaces is on {old.device}; "
                f"move it there first (`new.to({str(old.device)!r})`, or build it with device=h.device)")
        if new.dtype != old.dtype and not dtype_change:
            raise ReplacementError(
                f"replacement for {where} has dtype {new.dtype} but the value it replaces has {old.dtype}; "
                f"convert it (`new.to({old.dtype})`), or opt in with "
                f"`{point_name}.replace(value, dtype_change=True)` to change the dtype on purpose")
        if new.shape != old.shape and not shape_change:
            hint = ""
            if old.dim() >= 2 and tuple(new.shape) == tuple(old.shape[1:]):
                hint = (" It has the shape of one batch row: was it taken with `[0]`? Modules that return a "
                        "tensor (transformers 5 decoder layers do) give the batch at [0], not the hidden states.")
            raise ReplacementError(
                f"replacement for {where} has shape {tuple(new.shape)} but the value it replaces has shape "
                f"{tuple(old.shape)}; this invoke's view is what must be matched (use .expand/.reshape, or "
                "edit the awaited tensor in place). To change the shape on purpose, use "
                f"`{point_name}.replace(value, shape_change=True)`." + hint)
        return
    if isinstance(old, (tuple, list)):
        if not isinstance(new, (tuple, list)) or len(new) != len(old):
            raise ReplacementError(
                f"replacement for {where} must be a {type(old).__name__} of {len(old)} items like the original, "
                f"got {type(new).__name__}" + (f" of {len(new)}" if isinstance(new, (tuple, list)) else ""))
        for i, (n, o) in enumerate(zip(new, old)):
            check_replacement(point_name, n, o, f"{path}[{i}]", shape_change, dtype_change)
        return
    if isinstance(old, dict):
        if not isinstance(new, dict) or set(new) != set(old):
            raise ReplacementError(f"replacement for {where} must be a mapping with keys {sorted(old)}")
        for k in old:
            check_replacement(point_name, new[k], old[k], f"{path}[{k!r}]", shape_change, dtype_change)
