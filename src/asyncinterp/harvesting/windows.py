"""Dataset rows to fixed token windows, streamed: what a harvest runs the model on.

Why this module exists: a harvest reads a dataset too large for memory and
cuts it into windows of ``context_size`` tokens with the conventions SAELens's
``ActivationsStore`` uses by default, so that a harvest and a SAELens run over
the same dataset see the same windows:

* text rows are tokenised without special tokens, then packed back to back
  across documents; every window starts with the BOS token
  (``prepend_bos=True``) and documents after the first in a window are
  preceded by a separator (``separator="bos"``: the BOS token); a document
  that already starts with the token is not given another;
* ``packing="truncate"`` (SAELens's ``disable_concat_sequences``) keeps each
  document's first window only and drops documents shorter than a window;
* pre-tokenised rows (a column of token id lists) are windows already, as in
  SAELens: each row's first ``context_size`` ids; a shorter row is an error.

Sources: a ``datasets`` ``Dataset`` or ``IterableDataset``, a directory saved
with ``save_to_disk``, or JSONL / JSON / Parquet / Arrow files (a path, a glob
or a list), read with ``datasets`` in streaming mode. Nothing here holds more
than one batch of rows.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import os
from dataclasses import dataclass

import torch

__all__ = ["WindowSpec", "open_rows", "windows"]

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


@dataclass(frozen=True)
class WindowSpec:
    """How rows become windows (see the module docs); part of a harvest's manifest."""

    context_size: int = 128
    prepend_bos: bool = True
    separator: str | int | None = "bos"     # "bos" / "eos" / "sep", a token id, or None
    packing: str = "concat"                 # "concat" (across documents) or "truncate"
    column: str | None = None               # None: "text", else "input_ids" / "tokens"

    def __post_init__(self):
        if not isinstance(self.context_size, int) or self.context_size < 1:
            raise ValueError(f"context_size must be a positive int, got {self.context_size!r}")
        if self.packing not in ("concat", "truncate"):
            raise ValueError(f"packing must be 'concat' (across documents) or 'truncate', got {self.packing!r}")
        if not (self.separator is None or isinstance(self.separator, int)
                or self.separator in ("bos", "eos", "sep")):
            raise ValueError(f"separator must be 'bos', 'eos', 'sep', a token id or None, got {self.separator!r}")


def _files(source) -> list:
    items = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    out = []
    for item in items:
        item = os.fspath(item)
        found = sorted(glob.glob(item)) if any(c in item for c in "*?[") else [item]
        if not found or not all(os.path.isfile(f) for f in found):
            raise FileNotFoundError(f"dataset file(s) {item!r} not found: give a datasets object, a directory made by "
                                    "save_to_disk, or JSONL / Parquet / Arrow files")
        out += found
    return out


def open_rows(source, split: str = "train"):
    """``(rows, fingerprint)``: a ``datasets`` object over ``source`` that iterates rows without loading them
    all (see module docs), and what identifies the data in the manifest."""
    import datasets
    if isinstance(source, datasets.DatasetDict):
        if split not in source:
            raise ValueError(f"the DatasetDict has no split {split!r}; its splits: {sorted(source)}")
        source = source[split]
    if isinstance(source, datasets.Dataset):
        from datasets.fingerprint import generate_fingerprint     # from the dataset's state: its table or files
        return source, {"kind": "datasets-fingerprint", "value": generate_fingerprint(source)}
    if isinstance(source, datasets.IterableDataset):
        h = hashlib.sha256()        # an iterable dataset of unknown origin: its first rows stand for it
        for row in itertools.islice(iter(source), 64):
            h.update(json.dumps(row, sort_keys=True, default=str).encode())
        return source, {"kind": "sha256-of-first-64-rows", "value": h.hexdigest()}
    if isinstance(source, (str, os.PathLike)) and os.path.isdir(source):
        ds = datasets.load_from_disk(os.fspath(source))    # memory-mapped Arrow files, not read into memory
        rows, _ = open_rows(ds, split)
        # the fingerprint save_to_disk recorded (from the content), not one from this directory's path
        state = os.path.join(os.fspath(source), *( [split] if isinstance(ds, datasets.DatasetDict) else []),
                             "state.json")
        with open(state) as f:
            return rows, {"kind": "datasets-fingerprint", "value": json.load(f)["_fingerprint"]}
    if not isinstance(source, (str, os.PathLike, list, tuple)):
        raise TypeError(f"cannot harvest from {type(source).__name__}: give a datasets Dataset / IterableDataset, "
                        "a directory made by save_to_disk, or JSONL / Parquet / Arrow files")
    files = _files(source)
    kinds = {_FORMATS.get(os.path.splitext(f)[1].lower()) for f in files}
    if None in kinds or len(kinds) != 1:
        raise ValueError(f"cannot tell the format of {files}: give files ending in one of {sorted(_FORMATS)} "
                         "(all of one kind)")
    h = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    rows = datasets.load_dataset(kinds.pop(), data_files=files, split="train", streaming=True)
    return rows, {"kind": "sha256-of-files", "value": h.hexdigest(), "files": [os.path.basename(f) for f in files]}


def _column(names, spec: WindowSpec) -> str:
    if spec.column is not None:
        if names and spec.column not in names:
            raise ValueError(f"the dataset has no column {spec.column!r}; its columns: {names}")
        return spec.column
    for name in ("text", "input_ids", "tokens"):
        if name in names:
            return name
    raise ValueError(f"which column holds the text or token ids? none of 'text', 'input_ids', 'tokens' is among "
                     f"the dataset's columns {names}: pass column=...")


def _special(tokenizer, which):
    if which is None or isinstance(which, int):
        return which
    value = getattr(tokenizer, f"{which}_token_id", None)
    if value is None:
        raise ValueError(f"the tokenizer has no {which} token: choose another separator= or separator=None")
    return int(value)


def _documents(rows, column, tokenizer, chunk: int = 64):
    """Token id lists, one per row; text is tokenised in chunks (no special tokens, as SAELens does)."""
    texts = []
    for row in rows:
        value = row[column]
        if isinstance(value, str):
            texts.append(value)
            if len(texts) >= chunk:
                yield from tokenizer(texts, add_special_tokens=False)["input_ids"]
                texts = []
            continue
        if texts:
            yield from tokenizer(texts, add_special_tokens=False)["input_ids"]
            texts = []
        yield list(value.tolist() if isinstance(value, torch.Tensor) else value)
    if texts:
        yield from tokenizer(texts, add_special_tokens=False)["input_ids"]


def _pack(docs, size, bos, sep):
    """SAELens's ``concat_and_batch_sequences`` (begin-batch token ``bos``, separator ``sep``)."""
    window = None
    for doc in docs:
        offset = 0
        while offset < len(doc):
            prefix = []
            first = doc[offset]
            if window is None:
                if bos is not None and first != bos:
                    prefix.append(bos)
                need = max(size - len(prefix), 0)
                window = prefix[:size] + doc[offset:offset + need]
            else:
                if sep is not None and first != sep:
                    prefix.append(sep)
                room = max(size - len(window), 0)
                need = max(room - len(prefix), 0)
                window = window + prefix[:room] + doc[offset:offset + need]
            offset += need
            if len(window) == size:
                yield window
                window = None


def _truncate(docs, size, bos):
    for doc in docs:
        if not doc:
            continue
        if bos is not None and len(doc) >= size - 1 and doc[0] != bos:
            doc = [bos] + doc[:size - 1]
        if len(doc) >= size:
            yield doc[:size]


def windows(rows, spec: WindowSpec, tokenizer):
    """Yield the windows of ``rows`` (lists of ``context_size`` ids) in order, streaming."""
    it = iter(rows)
    first = next(it, None)
    if first is None:
        return
    column = _column(getattr(rows, "column_names", None) or list(first), spec)
    rows_again = itertools.chain([first], it)
    size = spec.context_size
    if not isinstance(first[column], str):          # pre-tokenised: rows are windows already
        for i, row in enumerate(rows_again):
            ids = row[column]
            ids = list(ids.tolist() if isinstance(ids, torch.Tensor) else ids)
            if len(ids) < size:
                raise ValueError(f"pre-tokenised row {i} has {len(ids)} ids, fewer than context_size={size}: "
                                 "pre-tokenised rows are windows (as in SAELens); pass text, or a smaller "
                                 "context_size")
            yield ids[:size]
        return
    if tokenizer is None:
        raise ValueError("text rows need a tokenizer: the model has none (pass tokenizer=...)")
    bos = _special(tokenizer, "bos") if spec.prepend_bos else None
    docs = _documents(rows_again, column, tokenizer)
    if spec.packing == "truncate":
        yield from _truncate(docs, size, bos)
    else:
        yield from _pack(docs, size, bos, _special(tokenizer, spec.separator))
