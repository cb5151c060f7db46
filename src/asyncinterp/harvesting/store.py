"""A harvest's directory: shards written atomically, a manifest that makes a rerun resume, and the final index.

Why this module exists: the output must be what the field's tools read and
must survive being killed at any moment. The directory (a local path or any
fsspec URL: ``file://``, ``memory://``, ``s3://`` ...) holds::

    harvest.json                     the manifest: what this harvest is (model, points, windows, dataset...)
    data-00000.arrow ...             shard k: windows [k*S, (k+1)*S), written to a temporary name, then renamed
    reductions-00000.safetensors     the reductions' state after shard k (when the run has reductions)
    dataset_info.json, state.json    written last: the directory is then a datasets Dataset (load_from_disk)

Every file is a function of the manifest and the data only (no timestamps, no
paths, no random fingerprints), so a run killed and resumed any number of
times ends with the same bytes as an uninterrupted one. A rerun on a
directory whose manifest differs is refused before anything is written.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
import uuid

__all__ = ["Store", "ManifestMismatch", "MANIFEST"]

MANIFEST = "harvest.json"
_SHARD = re.compile(r"data-(\d{5})\.arrow$")
_TMP = ".tmp-"


class ManifestMismatch(ValueError):
    """The output directory holds another harvest (another model, points, windows...)."""


def canonical(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def _diff(old, new, prefix=""):
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} (in the directory) != {b!r} (this run)")
    return out


class Store:
    """The files of one harvest directory (see the module docs)."""

    def __init__(self, out, storage_options: dict | None = None):
        import fsspec
        self.url = str(out)
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        self.storage_options = storage_options or {}

    def path(self, name: str) -> str:
        return posixpath.join(self.root, name)

    # ------------------------------------------------------------ atomic writes
    def _tmp(self, name: str) -> str:
        return self.path(f"{name}{_TMP}{uuid.uuid4().hex[:8]}")

    def commit(self, tmp: str, name: str) -> None:
        """Rename ``tmp`` to ``name``: the file appears whole or not at all."""
        self.fs.mv(tmp, self.path(name))

    def write_bytes(self, name: str, data: bytes) -> None:
        tmp = self._tmp(name)
        with self.fs.open(tmp, "wb") as f:
            f.write(data)
        self.commit(tmp, name)

    def exists(self, name: str) -> bool:
        return self.fs.exists(self.path(name))

    def read_bytes(self, name: str) -> bytes:
        with self.fs.open(self.path(name), "rb") as f:
            return f.read()

    # ------------------------------------------------------------ manifest and resume
    def open(self, manifest: dict, marker: str = "data", count: bool = True) -> int | None:
        """Check or write the manifest; remove unfinished temporary files; return the completed shard count
        (``count=False``: not counted; a Ray run completes shards out of order, see :mod:`.on_ray`)."""
        self.fs.makedirs(self.root, exist_ok=True)
        if self.exists(MANIFEST):
            old = json.loads(self.read_bytes(MANIFEST))
            if old != json.loads(canonical(manifest)):
                lines = _diff(old, json.loads(canonical(manifest)))
                raise ManifestMismatch(
                    f"{self.url} holds another harvest; the manifests differ in:\n  " + "\n  ".join(lines[:20]) +
                    "\nrerun with the same arguments to resume it, or give another output directory")
        else:
            names = self.names()
            if names:
                raise ManifestMismatch(f"{self.url} is not empty and has no {MANIFEST} (it holds {names[:5]}): "
                                       "give an empty or new directory")
            self.write_bytes(MANIFEST, canonical(manifest).encode())
        for name in self.names():
            if _TMP in name:
                self.fs.rm(self.path(name))
        return self.completed(marker) if count else None

    def names(self) -> list:
        if not self.fs.exists(self.root):
            return []
        return sorted(posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self.root, detail=False))

    def completed(self, marker: str = "data") -> int:
        """The number of completed shards (files ``data-00000.arrow`` ... with no gap)."""
        pattern = _SHARD if marker == "data" else re.compile(r"reductions-(\d{5})\.safetensors$")
        found = sorted(int(m.group(1)) for n in self.names() for m in [pattern.match(n)] if m)
        if found != list(range(len(found))):
            raise RuntimeError(f"{self.url}: shards {found} have a gap; the directory was changed by hand "
                               "(remove the shards after the gap to resume)")
        return len(found)

    # ------------------------------------------------------------ shards
    @staticmethod
    def shard_name(k: int) -> str:
        return f"data-{k:05d}.arrow"

    def write_shard(self, k: int, features, columns: dict) -> None:
        """Write shard ``k`` (``columns``: name -> numpy array with one row per window) atomically."""
        from datasets.arrow_writer import ArrowWriter
        name = self.shard_name(k)
        tmp = self._tmp(name)
        with self.fs.open(tmp, "wb") as f:
            writer = ArrowWriter(features=features, stream=f)
            writer.write_batch(columns)
            writer.finalize()
        self.commit(tmp, name)

    def write_state(self, k: int, reductions) -> None:
        """Save every reduction's ``state_dict()`` after shard ``k`` (one safetensors file)."""
        from safetensors.torch import save
        tensors = {}
        for i, r in enumerate(reductions):
            for key, value in r.state_dict().items():
                tensors[f"{i}.{key}"] = value.detach().cpu().contiguous()
        self.write_bytes(f"reductions-{k:05d}.safetensors", save(tensors))

    def load_state(self, k: int, reductions) -> None:
        """Restore every reduction from the state saved after shard ``k``."""
        from safetensors.torch import load
        tensors = load(self.read_bytes(f"reductions-{k:05d}.safetensors"))
        for i, r in enumerate(reductions):
            prefix = f"{i}."
            r.load_state_dict({key[len(prefix):]: v for key, v in tensors.items() if key.startswith(prefix)})

    # ------------------------------------------------------------ the datasets index
    def finalize(self, n_shards: int, features) -> None:
        """Write ``dataset_info.json`` and ``state.json``: the directory becomes a datasets ``Dataset``."""
        from dataclasses import asdict

        import datasets
        info = asdict(datasets.DatasetInfo(features=features))
        self.write_bytes("dataset_info.json", json.dumps({k: info[k] for k in sorted(info)}, indent=2).encode())
        files = [self.shard_name(k) for k in range(n_shards)]
        content = hashlib.sha256(self.read_bytes(MANIFEST))
        for name in files:
            content.update(self.shard_digest(name).encode())
        state = {"_data_files": [{"filename": n} for n in files], "_fingerprint": content.hexdigest()[:16],
                 "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
                 "_output_all_columns": False, "_split": None}
        self.write_bytes("state.json", json.dumps(state, indent=2, sort_keys=True).encode())

    def shard_digest(self, name: str) -> str:
        h = hashlib.sha256()
        with self.fs.open(self.path(name), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        return h.hexdigest()
