"""The harvest loop: windows in batches through an engine, into shard buffers, onto disk; reductions beside.

Why this module exists: this is the one place that orders the work of a
harvest so that it is resumable and bounded. Windows are numbered in dataset
order; shard ``k`` holds windows ``[k*S, (k+1)*S)``; a batch never crosses a
shard. Memory holds one shard's stored values (the buffer: ``buffer_mb``
decides ``S`` unless ``shard_windows`` is given) plus one batch in flight.
On resume the completed shards are skipped (their windows are cut again from
the stream, not computed), the reductions' state saved with the last one is
restored, and the run goes on where it stopped.
"""

from __future__ import annotations

import copy
import itertools
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .in_engine import run_batch
from .points import STORAGE_DTYPES, kept

__all__ = ["HarvestResult", "run_loop"]


@dataclass
class HarvestResult:
    """What ``ai.harvest`` returns: where, how much, and the reductions' results."""

    path: str
    windows: int
    tokens: int
    shards: int
    resumed_shards: int                  # shards found complete on disk and not recomputed
    seconds: float
    reductions: dict = field(default_factory=dict)
    manifest: dict = field(default_factory=dict)
    computed_shards: int | None = None   # shards this run computed (on Ray: the blocks the actors finished)

    @property
    def tokens_per_second(self) -> float:
        computed = self.tokens * (1 - self.resumed_shards / max(self.shards, 1))
        return computed / self.seconds if self.seconds else float("nan")


def features_for(columns: dict, dtype: str, positions: int):
    """The datasets ``Features`` of a harvest: one ``Array2D`` per point, and ``token_ids`` (as SAELens)."""
    from datasets import Array2D, Features, Sequence, Value
    arrow = STORAGE_DTYPES[dtype][1]
    feats = {name: Array2D(shape=(positions, dim), dtype=arrow) for name, dim in columns.items()}
    feats["token_ids"] = Sequence(Value("int32"), length=positions)
    return Features(feats)


def _to_storage(t: torch.Tensor, dtype: str) -> np.ndarray:
    torch_dtype = STORAGE_DTYPES[dtype][0]
    t = t.to(torch_dtype)
    if torch_dtype is torch.bfloat16:               # Arrow has no bfloat16: its bits, as uint16
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


class _Shard:
    """The buffer of one shard: stored values of its windows, filled batch by batch."""

    def __init__(self, index, size, positions_kept, dims, dtype):
        self.index = index
        self.filled = 0
        np_dtype = np.uint16 if dtype == "bfloat16" else np.dtype(STORAGE_DTYPES[dtype][1])
        self.columns = {name: np.empty((size, positions_kept, d), dtype=np_dtype) for name, d in dims.items()}
        self.columns["token_ids"] = np.empty((size, positions_kept), dtype=np.int32)

    def add(self, acts, tokens, dtype):
        n = tokens.shape[0]
        for name, value in acts.items():
            self.columns[name][self.filled:self.filled + n] = _to_storage(value, dtype)
        self.columns["token_ids"][self.filled:self.filled + n] = tokens.numpy()
        self.filled += n

    def rows(self):
        return {k: v[:self.filled] for k, v in self.columns.items()}


def _batches(window_iter, batch_size, shard_windows, first_window):
    """``(window_ids, ids [B, T])`` batches that never cross a shard boundary."""
    index = first_window
    while True:
        room = shard_windows - index % shard_windows
        rows = list(itertools.islice(window_iter, min(batch_size, room)))
        if not rows:
            return
        yield torch.arange(index, index + len(rows)), torch.tensor(rows, dtype=torch.long)
        index += len(rows)


def run_loop(engine, store, window_iter, *, specs, positions, dtype, context_size, batch_size, shard_windows,
             max_windows, reductions, save_activations, progress, manifest, done, writer=True) -> HarvestResult:
    """Run the harvest (see the module docs); ``store.open`` has said that ``done`` shards exist.

    ``writer=False`` (tensor-parallel ranks but rank 0): compute every batch, write nothing.
    """
    from tqdm.auto import tqdm
    start = time.perf_counter()
    empty = [copy.deepcopy(r) for r in reductions]     # before any state: what in-engine reductions start from
    if done and reductions:
        store.load_state(done - 1, reductions)
    first = done * shard_windows
    if max_windows is not None:
        window_iter = itertools.islice(window_iter, max_windows)
    window_iter = itertools.islice(window_iter, first, None)     # completed shards: cut again, not computed
    p_kept = kept(positions, context_size)
    total = None if max_windows is None else max(max_windows - first, 0) * context_size
    bar = tqdm(total=total, unit="tok", unit_scale=True, desc="harvest", disable=not progress, smoothing=0.1)
    if done:
        bar.write(f"harvest: resuming {store.url} at shard {done} (window {first}); "
                  f"{done} shard(s) already complete")
    shard = None
    columns_dims = None
    n_shards, last_window = done, first
    tok_slice = slice(-1, None) if positions == -1 else positions

    def finish(sh):
        if not writer:
            return
        if reductions:
            store.write_state(sh.index, reductions)
        if save_activations:
            store.write_shard(sh.index, features_for(columns_dims, dtype, p_kept), sh.rows())

    for window_ids, ids in _batches(iter(window_iter), batch_size, shard_windows, first):
        k = int(window_ids[0]) // shard_windows
        if shard is not None and shard.index != k:
            finish(shard)                   # the reductions' state as of the end of that shard
            shard = None
        acts = run_batch(engine, ids, window_ids, reductions, empty, save_activations)
        if shard is None:
            if columns_dims is None:
                columns_dims = {name: v.shape[-1] for name, v in acts.items()}
            shard = _Shard(k, shard_windows, p_kept, columns_dims if save_activations else {}, dtype)
        if save_activations:
            shard.add(acts, ids[:, tok_slice], dtype)
        else:
            shard.filled += len(window_ids)
        n_shards = k + 1
        last_window = int(window_ids[-1]) + 1
        bar.update(ids.numel())
    if shard is not None:
        finish(shard)
    bar.close()
    if n_shards == 0:
        raise ValueError("the dataset gave no window: it is empty, or every document is shorter than "
                         f"context_size={context_size} with packing='truncate'")
    if save_activations and writer:
        if columns_dims is None:                     # every shard was on disk already
            from datasets import Features
            columns_dims = _dims_on_disk(store, Features)
        store.finalize(n_shards, features_for(columns_dims, dtype, p_kept))
    results = {}
    for i, r in enumerate(reductions):
        name = getattr(r, "name", None) or f"reduction{i}"
        results[name] = r.result()
        _write_result(store, name, results[name])
    windows = last_window if last_window > first or not writer else _windows_on_disk(
        store, n_shards, shard_windows, save_activations)
    return HarvestResult(path=store.url, windows=windows, tokens=windows * context_size, shards=n_shards,
                         resumed_shards=done, seconds=time.perf_counter() - start, reductions=results,
                         manifest=manifest, computed_shards=n_shards - done)


def _dims_on_disk(store, features_cls) -> dict:
    import pyarrow as pa
    with store.fs.open(store.path(store.shard_name(0)), "rb") as f:
        schema = pa.ipc.open_stream(f).schema
    feats = features_cls.from_arrow_schema(schema)
    return {name: feat.shape[1] for name, feat in feats.items() if name != "token_ids"}


def _windows_on_disk(store, n_shards, shard_windows, save_activations) -> int:
    if not save_activations or n_shards == 0:
        return n_shards * shard_windows
    import pyarrow as pa
    with store.fs.open(store.path(store.shard_name(n_shards - 1)), "rb") as f:
        last = pa.ipc.open_stream(f).read_all().num_rows
    return (n_shards - 1) * shard_windows + last


def _write_result(store, name, value) -> None:
    """Write a reduction's result: tensors as safetensors, JSON-able values as JSON, other values not at all."""
    import json

    from safetensors.torch import save
    if isinstance(value, torch.Tensor):
        value = {"result": value}
    if isinstance(value, dict) and value and all(isinstance(v, torch.Tensor) for v in value.values()):
        store.write_bytes(f"result-{name}.safetensors",
                          save({k: v.detach().cpu().contiguous() for k, v in value.items()}))
        return
    try:
        text = json.dumps(value, indent=2, sort_keys=True)
    except TypeError:
        return
    store.write_bytes(f"result-{name}.json", text.encode())
