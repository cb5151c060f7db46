"""Harvest: activations over a whole dataset, at engine speed, to disk, resumable (``ai.harvest``).

Why this package exists: training SAEs, transcoders and probes needs the
activations of a point over millions of tokens, more than memory holds.
``ai.harvest`` streams a dataset into fixed windows (SAELens's conventions),
runs them through the model's engine in batches (transformers forwards, or
vLLM's own scheduler), and writes shards of a ``datasets`` directory laid out
as SAELens's ``CacheActivationsRunner`` writes it, so SAELens trains from it
unchanged::

    import asyncinterp as ai
    result = ai.harvest(model, "data.jsonl", ["blocks.6.hook_resid_post"], "out/", context_size=128)
    ds = ai.harvest.open("out/")                 # a torch Dataset over the harvest
    datasets.load_from_disk("out/")              # or the field's own reader

Killed at any moment and started again with the same arguments, it resumes
from the last completed shard and ends byte-identical to an uninterrupted
run. Reductions (``reductions=[...]``, see :mod:`.batch`) see every batch
where the activations are. The command line: ``asyncinterp harvest MODEL
--dataset ... --points ... --out DIR``. See docs/harvest.md.

The parts: :mod:`.windows` (rows to windows), :mod:`.points` (names, positions,
dtypes), :mod:`.engines`, :mod:`.loop`, :mod:`.store` (files), :mod:`.manifest`,
:mod:`.reading` (``open``), :mod:`.cli`.
"""

from __future__ import annotations

from .batch import HarvestBatch, Reduction

__all__ = ["Harvest", "HarvestBatch", "Reduction", "harvest"]


class Harvest:
    """``ai.harvest(model, dataset, points, out, ...)``: see :meth:`__call__`; ``ai.harvest.open(dir)`` reads one."""

    def __call__(self, model, dataset, points, out, *, context_size: int = 128, prepend_bos: bool = True,
                 separator="bos", packing: str = "concat", column: str | None = None, split: str = "train",
                 positions="all", dtype="float32", batch_size: int = 8, shard_windows: int | None = None,
                 buffer_mb: float = 256, max_windows: int | None = None, max_tokens: int | None = None,
                 reductions=(), save_activations: bool = True, tokenizer=None, storage_options=None,
                 progress: bool = True, stop_early: bool = True, ray=None):
        """Harvest ``points`` of ``model`` over ``dataset`` into the directory (or fsspec URL) ``out``.

        * ``model``: an ``ai.LanguageModel`` (transformers forwards) or ``ai.VLLM`` (prompt-only requests).
        * ``dataset``: a ``datasets`` Dataset / IterableDataset / DatasetDict (``split``), a directory made by
          ``save_to_disk``, or JSONL / Parquet / Arrow file(s); ``column``: the text or token-id column.
        * windows: ``context_size`` tokens, ``prepend_bos``, ``separator`` between packed documents,
          ``packing="concat"`` or ``"truncate"`` (SAELens's defaults; see :mod:`.windows`).
        * ``points``: names ``m.at`` resolves (``blocks.6.hook_resid_post``, ``layers.6.attn.z``, ...);
          stored under their TransformerLens names. ``positions``: ``"all"``, ``"last"`` or a slice.
          ``dtype``: storage dtype, ``fp32`` / ``fp16`` / ``bf16``.
        * ``batch_size`` windows per forward; a shard holds ``shard_windows`` windows (default: as many as
          ``buffer_mb`` of stored values allows, a multiple of ``batch_size``); ``max_windows`` /
          ``max_tokens`` stop early.
        * ``reductions``: objects with ``update(HarvestBatch)`` ... (see :mod:`.batch`);
          ``save_activations=False`` keeps only their results.
        * ``stop_early`` (transformers): stop each forward after the last harvested point.

        * ``ray``: compute the shards on N engine actors of a Ray cluster through Ray Data (``True``, an
          address, or :class:`~.on_ray.RayOptions`); the same files as one process (see :mod:`.on_ray`).

        Returns a :class:`~.loop.HarvestResult`.
        """
        from .engines import engine_for
        from .loop import run_loop
        from .manifest import build_manifest
        from .points import PointSpec, column_name, kept, parse_positions, storage_dtype
        from .ranks import on_rank0, world
        from .store import Store
        from .windows import WindowSpec, open_rows, windows

        spec = WindowSpec(context_size=context_size, prepend_bos=prepend_bos, separator=separator,
                          packing=packing, column=column)
        if isinstance(points, str):
            points = [points]
        points = list(points)
        if not points:
            raise ValueError("give at least one point to harvest (e.g. 'blocks.6.hook_resid_post')")
        specs = []
        for p in points:
            if not isinstance(p, str):
                raise TypeError(f"points are names (strings such as 'blocks.6.hook_resid_post'), got {p!r}")
            model.at(p)                              # an unknown name fails here, before any compute
            specs.append(PointSpec(p, column_name(p)))
        columns = [s.column for s in specs]
        if len(set(columns)) != len(columns) or "token_ids" in columns:
            raise ValueError(f"points {points} give the columns {columns}: each point once, none named token_ids")
        positions = parse_positions(positions)
        kept(positions, context_size)
        dtype = storage_dtype(dtype)
        reductions = list(reductions or ())
        if not save_activations and not reductions:
            raise ValueError("save_activations=False with no reductions would compute nothing to keep")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if max_tokens is not None:
            max_windows = min(max_windows or max_tokens // context_size, max_tokens // context_size)
        if shard_windows is None:
            shard_windows = _shard_size(model, specs, positions, context_size, dtype, batch_size, buffer_mb)
        if shard_windows % batch_size:
            raise ValueError(f"shard_windows={shard_windows} must be a multiple of batch_size={batch_size} "
                             "(a batch never crosses a shard)")
        tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        rows, dataset_id = open_rows(dataset, split)
        dataset_id = {**dataset_id, "split": split}
        engine = engine_for(model, specs, positions, reduce_only=bool(reductions) and not save_activations,
                            **({} if type(model).__name__ == "VLLM" else {"stop_early": stop_early}))
        rank, ranks = world() if engine.kind == "transformers" else (0, 1)   # vLLM: its own workers
        kind = engine.kind if ranks == 1 else f"{engine.kind}-tp{ranks}"
        manifest = build_manifest(model, kind, specs, positions, dtype, spec, batch_size, shard_windows,
                                  max_windows, tokenizer, dataset_id, reductions, save_activations, stop_early)
        store = Store(out, storage_options)
        if ray is not None:
            if ranks > 1:
                raise ValueError("ray= runs one engine per actor; it does not combine with tensor-parallel ranks "
                                 "launched around this call (give each actor its own model instead)")
            store.open(manifest, count=False)
            from .on_ray import run_on_ray
            return run_on_ray(ray, model, store, windows(rows, spec, tokenizer), specs=specs, positions=positions,
                              dtype=dtype, context_size=context_size, batch_size=batch_size,
                              shard_windows=shard_windows, max_windows=max_windows, reductions=reductions,
                              save_activations=save_activations, progress=progress, manifest=manifest,
                              stop_early=stop_early, storage_options=storage_options)
        # under tensor parallelism every rank computes, rank 0 alone owns the directory (see .ranks)
        done = on_rank0(lambda: store.open(manifest, "data" if save_activations else "reductions"))
        return run_loop(engine, store, windows(rows, spec, tokenizer), specs=specs, positions=positions,
                        dtype=dtype, context_size=context_size, batch_size=batch_size,
                        shard_windows=shard_windows, max_windows=max_windows,
                        reductions=reductions if rank == 0 else [], save_activations=save_activations,
                        progress=progress and rank == 0, manifest=manifest, done=done, writer=rank == 0)

    @staticmethod
    def open(path, columns=None, storage_options=None):
        """A torch ``Dataset`` over the harvest in ``path`` (see :mod:`.reading`)."""
        from .reading import HarvestDataset
        return HarvestDataset(path, columns=columns, storage_options=storage_options)

    def __repr__(self):
        return "<ai.harvest: harvest(model, dataset, points, out, ...); harvest.open(dir)>"


def _shard_size(model, specs, positions, context_size, dtype, batch_size, buffer_mb) -> int:
    """Windows per shard: as many as ``buffer_mb`` of stored values holds (a multiple of ``batch_size``)."""
    from .points import STORAGE_DTYPES, kept
    module = getattr(model, "module", None)
    config = getattr(module, "config", None)
    if config is None and type(model).__name__ == "VLLM":
        config = model.llm.llm_engine.model_config.hf_config
    hidden = getattr(config, "hidden_size", None) or 1024
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    # an upper estimate of a point's width (an MLP's hidden layer is the widest common point)
    width = max(hidden, intermediate)
    per_window = kept(positions, context_size) * width * len(specs) * STORAGE_DTYPES[dtype][0].itemsize
    windows = max(int(buffer_mb * (1 << 20) // max(per_window, 1)), 1)
    return max(windows // batch_size, 1) * batch_size


harvest = Harvest()
