"""Shared set-up for the harvest tests: a small text corpus as files, hashes of a directory, hand-written hooks."""

from __future__ import annotations

import hashlib
import json
import os

import torch

WORDS = ("the quick brown fox jumps over a lazy dog while seven small birds sing about rivers mountains and "
         "distant cities where people read old books").split()


def corpus(n: int = 120, seed: int = 0) -> list:
    """``n`` documents of varied length (some shorter, some longer than a window), deterministic."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for i in range(n):
        length = int(torch.randint(3, 90, (1,), generator=g))
        idx = torch.randint(0, len(WORDS), (length,), generator=g).tolist()
        docs.append(f"Doc {i}. " + " ".join(WORDS[j] for j in idx))
    return docs


def write_jsonl(path, docs) -> str:
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    return str(path)


def sha256_tree(root) -> dict:
    """``{relative path: sha256}`` of every file under ``root``."""
    out = {}
    for base, _, files in os.walk(root):
        for name in files:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def hook_values(module, ids, hooks: dict) -> dict:
    """Run ``module(ids)`` with plain torch hooks: ``hooks`` maps a name to ``(submodule, "output" | "input")``
    (the submodule's output, or its first positional input); returns copies of what they saw."""
    got, handles = {}, []
    for name, (sub, kind) in hooks.items():
        if kind == "output":
            handles.append(sub.register_forward_hook(lambda m, a, o, name=name: got.__setitem__(name, o.clone())))
        else:
            handles.append(sub.register_forward_pre_hook(lambda m, a, name=name: got.__setitem__(name, a[0].clone())))
    try:
        with torch.no_grad():
            module(ids)
    finally:
        for h in handles:
            h.remove()
    return got
