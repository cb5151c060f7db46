"""A harvest past one machine: shards computed by N engine actors through Ray Data, same files as one process.

Why this module exists: one process runs one engine. With ``ray=`` (or
``asyncinterp harvest --ray-address ADDR``) the driver cuts the windows
(one streaming pass, as a local run does; each shard's windows go to Ray's
object store as they are cut, 4 bytes a token, spilled to disk when large), and Ray Data maps
the shards, one block each, over an actor pool
(``map_batches(ShardWorker, concurrency=N)``): each actor holds an engine,
computes whole shards and writes them to the output directory (a path every
node sees, or an fsspec URL), and writes its reductions' partial state beside
them. Only that state and a shard count come back; activations never pass
through the driver.

The driver then does what the local loop does between shards: it folds the
partial states in shard order and writes ``reductions-K.safetensors`` (the
state after shard ``K``, the same bytes as a local run, since merging the
reductions' states of disjoint windows gives the same bits as updating one
state, see :mod:`.reductions`), and at the end the datasets index and the
results. The directory is byte-identical to a one-process run.

Failures: Ray Data restarts a dead actor and retries its block. A shard's
files are written under temporary names and renamed (atomic), are named by
shard index (a redo writes the same name), and a worker that finds its shard
complete returns without writing it again. Killed and started again with the
same arguments, a run computes only the shards missing on disk.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .in_engine import run_batch
from .store import Store

__all__ = ["RayOptions", "ShardWorker", "run_on_ray"]

_PART = "reductions-part-{:05d}.safetensors"


@dataclass
class RayOptions:
    """``ai.harvest(..., ray=RayOptions(...))``; ``ray=True`` / ``ray="ADDRESS"`` are the short forms.

    * ``address``: the cluster (``"auto"``, ``"ray://host:10001"``, ``"host:6379"``); ``None``: the Ray this
      process is connected to, or a new local one;
    * ``actors``: engine actors (Ray Data's actor pool size), ``num_cpus`` / ``num_gpus`` each;
    * ``model``: a picklable callable that builds the model on each actor (``functools.partial(
      ai.LanguageModel.from_pretrained, path)``); by default the driver's transformers model is shipped to the
      actors by value, with its attached modules and edits (:class:`Rebuild`; fine for small models; an
      ``ai.VLLM`` engine must be built on the actor);
    * ``start_timeout``: seconds the actors may take to start (placed, model loaded) before it is an error
      (a cluster without room for them); ``timeout``: seconds the whole run may take.
    """

    address: str | None = None
    actors: int = 2
    num_cpus: float = 1
    num_gpus: float = 0
    model: object = None
    timeout: float = 24 * 3600
    start_timeout: float = 600
    ray_remote_args: dict = field(default_factory=dict)

    @classmethod
    def of(cls, value) -> "RayOptions":
        if isinstance(value, cls):
            return value
        if value is True:
            return cls()
        if isinstance(value, str):
            return cls(address=value)
        if isinstance(value, dict):
            return cls(**value)
        raise TypeError(f"ray= takes True, a cluster address, a dict of RayOptions fields or RayOptions; "
                        f"got {value!r}")

    def __post_init__(self):
        if not isinstance(self.actors, int) or self.actors < 1:
            raise ValueError(f"RayOptions.actors must be a positive int, got {self.actors!r}")


def _state_bytes(reductions) -> bytes:
    from safetensors.torch import save
    tensors = {}
    for i, r in enumerate(reductions):
        for key, value in r.state_dict().items():
            tensors[f"{i}.{key}"] = value.detach().cpu().contiguous()
    return save(tensors)


def _load_state(data: bytes, reductions) -> list:
    """Fresh copies of ``reductions`` holding the state in ``data`` (as ``Store.write_state`` wrote it)."""
    from safetensors.torch import load
    tensors = load(data)
    out = []
    for i, r in enumerate(reductions):
        prefix = f"{i}."
        r = copy.deepcopy(r)
        r.load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
        out.append(r)
    return out


class ShardWorker:
    """A Ray Data actor: an engine over the model, computing and writing whole shards (see the module docs)."""

    def __init__(self, factory, windows, specs, positions, dtype, context_size, batch_size, shard_windows,
                 reductions, save_activations, stop_early, out, storage_options):
        from .engines import engine_for
        torch.set_grad_enabled(False)
        model = factory()
        options = {} if type(model).__name__ == "VLLM" else {"stop_early": stop_early}
        self.engine = engine_for(model, specs, positions, reduce_only=bool(reductions) and not save_activations,
                                 **options)
        self.positions, self.dtype, self.context_size = positions, dtype, context_size
        self.batch_size, self.shard_windows = batch_size, shard_windows
        self.reductions = reductions          # as the user made them: never updated here, only copied
        self.save_activations = save_activations
        self.store = Store(out, storage_options)
        self.windows = windows                # shard index -> its windows [n, T] (an ObjectRef, or the array)

    def complete(self, k: int) -> bool:
        """Shard ``k``'s files are all on disk (its data, and its reductions' state when there are reductions)."""
        marker = self.store.shard_name(k) if self.save_activations else _PART.format(k)
        if not self.store.exists(marker):
            return False
        return not self.reductions or self.store.exists(_PART.format(k)) or self.store.exists(
            f"reductions-{k:05d}.safetensors")

    def __call__(self, batch: dict) -> dict:
        from .loop import _Shard, features_for
        from .points import kept
        k = int(batch["shard"][0])
        windows = self.windows[k]
        if not isinstance(windows, np.ndarray):
            import ray
            windows = ray.get(windows, timeout=600)
        ids = torch.as_tensor(windows, dtype=torch.long)
        if self.complete(k):                    # a retried block whose shard was finished: never written twice
            return {"shard": np.array([k]), "windows": np.array([ids.shape[0]]), "computed": np.array([False])}
        reductions = [copy.deepcopy(r) for r in self.reductions]
        p_kept = kept(self.positions, self.context_size)
        tok_slice = slice(-1, None) if self.positions == -1 else self.positions
        shard = dims = None
        first = k * self.shard_windows
        for s in range(0, ids.shape[0], self.batch_size):
            chunk = ids[s:s + self.batch_size]
            acts = run_batch(self.engine, chunk, torch.arange(first + s, first + s + chunk.shape[0]), reductions,
                             self.reductions, self.save_activations)
            if shard is None:
                dims = {name: v.shape[-1] for name, v in acts.items()}
                shard = _Shard(k, self.shard_windows, p_kept, dims if self.save_activations else {}, self.dtype)
            if self.save_activations:
                shard.add(acts, chunk[:, tok_slice], self.dtype)
        if reductions:                          # the state first: a shard's data file marks it complete
            self.store.write_bytes(_PART.format(k), _state_bytes(reductions))
        if self.save_activations:
            self.store.write_shard(k, features_for(dims, self.dtype, p_kept), shard.rows())
        elif not reductions:
            raise ValueError("nothing to keep: save_activations=False and no reductions")
        return {"shard": np.array([k]), "windows": np.array([ids.shape[0]]), "computed": np.array([True])}


class Rebuild:
    """A picklable recipe for a wrapped transformers model on an actor: its ``nn.Module`` and tokenizer, the
    modules attached to it (an SAE) and its persistent edits (a splice), in order (the wrapper holds locks and
    hooks state that do not travel)."""

    def __init__(self, model):
        from ..model import Model
        from ..models.hf.language import LanguageModel
        if type(model) not in (Model, LanguageModel):
            raise ValueError(f"a {type(model).__name__} model cannot be rebuilt on Ray actors: give "
                             "RayOptions(model=FACTORY), a picklable callable that builds it on each actor")
        self.cls = type(model)
        self.module = model.module
        self.tokenizer = getattr(model, "tokenizer", None)
        self.attached = {name: envoy.module for name, envoy in model.attachments.items()}
        self.edits = tuple(model.edits)

    def __call__(self):
        model = self.cls(self.module, self.tokenizer) if self.tokenizer is not None else self.cls(self.module)
        for name, module in self.attached.items():
            model.attach(name, module)
        for fn in self.edits:
            model = model.edit(fn)
        return model


def _connect(options: RayOptions):
    import ray
    if not ray.is_initialized():
        ray.init(address=options.address, logging_level="WARNING", log_to_driver=False)
    return ray


def _shards(window_iter, shard_windows):
    """``(k, windows [n, T] int64)`` for each shard, in order, from the window stream."""
    import itertools
    k = 0
    while True:
        rows = list(itertools.islice(window_iter, shard_windows))
        if not rows:
            return
        yield k, np.asarray(rows, dtype=np.int32 if max(map(max, rows)) < 2 ** 31 else np.int64)
        k += 1


def run_on_ray(options, engine_model, store: Store, window_iter, *, specs, positions, dtype, context_size,
               batch_size, shard_windows, max_windows, reductions, save_activations, progress, manifest,
               stop_early, storage_options=None):
    """The harvest of ``store`` on Ray (see the module docs); returns a :class:`~.loop.HarvestResult`."""
    import itertools

    from tqdm.auto import tqdm

    from .loop import HarvestResult, _dims_on_disk, _write_result
    options = RayOptions.of(options)
    if type(engine_model).__name__ == "VLLM" and options.model is None:
        raise ValueError("a vLLM engine cannot be shipped to Ray actors: give RayOptions(model=FACTORY), a "
                         "picklable callable that builds the ai.VLLM model on each actor")
    ray = _connect(options)
    start = time.perf_counter()
    pristine = [copy.deepcopy(r) for r in reductions]      # the actors' templates: no state
    if max_windows is not None:
        window_iter = itertools.islice(window_iter, max_windows)
    names = set(store.names())
    folded = _folded_prefix(names)                         # reductions-K written for K < folded
    running = _load_state(store.read_bytes(f"reductions-{folded - 1:05d}.safetensors"), pristine) \
        if reductions and folded else [copy.deepcopy(r) for r in pristine]
    marker = "data-{:05d}.arrow" if save_activations else _PART
    items, refs, n_shards, n_windows, sizes = [], {}, 0, 0, {}
    for k, windows in _shards(iter(window_iter), shard_windows):
        n_shards, n_windows, sizes[k] = k + 1, n_windows + len(windows), len(windows)
        done = (reductions and k < folded) or (
            marker.format(k) in names and (not reductions or _PART.format(k) in names))
        if not done:
            refs[k] = ray.put(windows)        # in the object store (spilled when large), not in this process
            items.append({"shard": k})
    if n_shards == 0:
        raise ValueError("the dataset gave no window: it is empty, or every document is shorter than "
                         f"context_size={context_size} with packing='truncate'")
    bar = tqdm(total=n_windows * context_size, unit="tok", unit_scale=True, desc="harvest (ray)",
               disable=not progress, smoothing=0.1)
    resumed = n_shards - len(items)
    bar.update(sum(sizes[k] for k in sizes if k not in {i["shard"] for i in items}) * context_size)
    computed = 0
    if items:
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False     # ours (tqdm) counts tokens
        context.wait_for_min_actors_s = int(options.start_timeout)
        ds = ray.data.from_items(items, override_num_blocks=len(items))
        factory = options.model if options.model is not None else Rebuild(engine_model)
        results = ds.map_batches(
            ShardWorker, batch_size=1, compute=ray.data.ActorPoolStrategy(size=options.actors),
            num_cpus=options.num_cpus,
            num_gpus=options.num_gpus or None, zero_copy_batch=True,
            fn_constructor_kwargs=dict(
                factory=factory, windows=refs, specs=specs, positions=positions, dtype=dtype,
                context_size=context_size, batch_size=batch_size, shard_windows=shard_windows,
                reductions=pristine, save_activations=save_activations, stop_early=stop_early,
                out=store.url, storage_options=storage_options),
            **options.ray_remote_args)
        with _Watchdog(options.timeout) as watchdog:
            try:
                for row in results.iter_rows():
                    watchdog.check()
                    computed += int(row["computed"])
                    bar.update(int(row["windows"]) * context_size)
                    if reductions:
                        folded = _fold(store, running, pristine, folded, n_shards, save_activations)
            except KeyboardInterrupt:
                if not watchdog.fired:
                    raise
                raise TimeoutError(f"the Ray harvest ran past its timeout of {options.timeout} s (RayOptions."
                                   "timeout); rerun with the same arguments to resume it") from None
    bar.close()
    if reductions:
        folded = _fold(store, running, pristine, folded, n_shards, save_activations)
        if folded != n_shards:
            raise RuntimeError(f"the Ray harvest ended with the reductions' state of shards {folded}..."
                               f"{n_shards - 1} missing: a worker failed to write it")
    missing = [k for k in range(n_shards) if not store.exists(marker.format(k))
               and not (reductions and k < folded and not save_activations)]
    if missing:
        raise RuntimeError(f"the Ray harvest ended with shards {missing[:10]} missing from {store.url}")
    for name in store.names():                # temporary files of killed actors (their shards were redone)
        if ".tmp-" in name:
            store.fs.rm(store.path(name))
    if save_activations:
        from datasets import Features

        from .loop import features_for
        from .points import kept
        store.finalize(n_shards, features_for(_dims_on_disk(store, Features), dtype, kept(positions, context_size)))
    out = {}
    for i, r in enumerate(running):
        name = getattr(r, "name", None) or f"reduction{i}"
        out[name] = r.result()
        _write_result(store, name, out[name])
    result = HarvestResult(path=store.url, windows=n_windows, tokens=n_windows * context_size, shards=n_shards,
                           resumed_shards=resumed, seconds=time.perf_counter() - start, reductions=out,
                           manifest=manifest, computed_shards=computed)
    return result


class _Watchdog:
    """Interrupts the main thread after ``seconds`` (Ray Data's iterator has no timeout of its own); from
    another thread, the deadline is checked only as rows arrive."""

    def __init__(self, seconds: float):
        import threading
        self.fired = False
        self.deadline = time.monotonic() + seconds
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True
        self._main = threading.current_thread() is threading.main_thread()

    def _fire(self):
        import _thread
        self.fired = True
        _thread.interrupt_main()

    def check(self) -> None:
        if time.monotonic() > self.deadline:
            self.fired = True
            raise KeyboardInterrupt

    def __enter__(self):
        if self._main:
            self._timer.start()
        return self

    def __exit__(self, *exc):
        self._timer.cancel()


def _folded_prefix(names) -> int:
    """How many ``reductions-K.safetensors`` files exist from ``K = 0`` without a gap."""
    k = 0
    while f"reductions-{k:05d}.safetensors" in names:
        k += 1
    return k


def _fold(store, running, pristine, folded, n_shards, save_activations) -> int:
    """Fold the partial states of shards ``folded, folded+1, ...`` that are complete on disk into ``running``, in
    shard order, writing the state after each (as a local run does); returns the new ``folded``."""
    while folded < n_shards and store.exists(_PART.format(folded)) and (
            not save_activations or store.exists(store.shard_name(folded))):
        part = _load_state(store.read_bytes(_PART.format(folded)), pristine)
        for r, p in zip(running, part):
            r.merge(p)
        store.write_bytes(f"reductions-{folded:05d}.safetensors", _state_bytes(running))
        store.fs.rm(store.path(_PART.format(folded)))
        folded += 1
    return folded

