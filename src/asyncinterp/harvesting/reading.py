"""``ai.harvest.open(dir)``: a finished harvest as a torch ``Dataset`` of per-window tensors.

Why this module exists: a harvest is a ``datasets`` directory (SAELens reads
it as is); a torch training loop wants tensors in the dtype they were stored
in. This wraps ``datasets.load_from_disk`` (memory-mapped: nothing is read
until indexed), gives each window as ``{column: tensor [P, D], "token_ids":
int64 [P]}``, restores bfloat16 columns (stored as their bits, since Arrow has
no bfloat16), and carries the manifest.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from .points import STORAGE_DTYPES
from .store import MANIFEST, Store

__all__ = ["HarvestDataset"]


class HarvestDataset(torch.utils.data.Dataset):
    """The windows of a finished harvest (see the module docs); ``manifest`` is its ``harvest.json``."""

    def __init__(self, path, columns=None, storage_options=None):
        import datasets
        store = Store(path, storage_options)
        if not store.exists(MANIFEST):
            raise FileNotFoundError(f"{path} is not a harvest: it has no {MANIFEST}")
        if not store.exists("state.json"):
            raise FileNotFoundError(f"the harvest in {path} is not finished (no state.json): rerun ai.harvest "
                                    "with the same arguments to complete it")
        self.manifest = json.loads(store.read_bytes(MANIFEST))
        self.path = str(path)
        self.data = datasets.load_from_disk(str(path), storage_options=storage_options)
        names = [c for c in self.data.column_names]
        if columns is not None:
            missing = [c for c in columns if c not in names]
            if missing:
                raise KeyError(f"the harvest has no column(s) {missing}; its columns: {names}")
            names = list(columns)
        self.columns = names
        self.data = self.data.with_format("numpy", columns=names)
        self.bf16 = self.manifest.get("dtype") == "bfloat16"
        self.dtype = STORAGE_DTYPES[self.manifest.get("dtype", "float32")][0]

    def __len__(self):
        return len(self.data)

    def _tensor(self, name, array):
        if name == "token_ids":
            return torch.from_numpy(np.asarray(array)).long()
        if self.bf16:       # the bits, as uint16 (the reader may widen them: narrow first)
            return torch.from_numpy(np.asarray(array).astype(np.uint16).view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(np.asarray(array)).to(self.dtype)    # the stored dtype (the reader may widen)

    def __getitem__(self, index):
        row = self.data[index]
        return {name: self._tensor(name, row[name]) for name in self.columns}

    def __repr__(self):
        return f"<harvest {self.path}: {len(self)} windows, columns {self.columns}, dtype {self.manifest['dtype']}>"
