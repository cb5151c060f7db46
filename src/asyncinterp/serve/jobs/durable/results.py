"""A job's answer as JSON and safetensors, and back: how results are kept without pickle.

A result is the tree that the blocking request would have answered (maps, lists, tuples, numbers,
strings, bytes, tensors: what :mod:`..wire` carries). Kept, it is two parts: a JSON text in which each
tensor is ``{"$t": NAME}`` and the tensors themselves in one safetensors blob (bit-exact, any dtype
safetensors knows). What JSON cannot hold as it is, is tagged: a tuple ``{"$tu": [...]}``, bytes
``{"$b": base64}``, a map whose keys are not all plain strings ``{"$m": [[key, value], ...]}``, a
tensor of a dtype safetensors lacks ``{"$w": base64 of its wire form}``. :func:`encode` and
:func:`decode` are exact inverses on every tree the wire carries.
"""

from __future__ import annotations

import base64
import json

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from ....client import wire

__all__ = ["encode", "decode"]


def encode(tree) -> tuple[str, bytes]:
    """``(json_text, safetensors_bytes)`` of ``tree``."""
    tensors = {}

    def walk(obj):
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, torch.Tensor):
            return tensor(obj)
        if isinstance(obj, tuple):
            return {"$tu": [walk(v) for v in obj]}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if isinstance(obj, (bytes, bytearray)):
            return {"$b": base64.b64encode(bytes(obj)).decode("ascii")}
        if isinstance(obj, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in obj):
                return {k: walk(v) for k, v in obj.items()}
            return {"$m": [[walk(k), walk(v)] for k, v in obj.items()]}
        raise TypeError(f"a job's result cannot hold {type(obj).__name__} (what the wire carries only)")

    def tensor(t):
        name = str(len(tensors))
        if t.layout != torch.strided or t.is_quantized or t.dtype.is_complex:
            return {"$w": base64.b64encode(wire.packb(t)).decode("ascii")}
        tensors[name] = t.detach().cpu().contiguous().clone()
        return {"$t": name}

    text = json.dumps(walk(tree), separators=(",", ":"))
    return text, (save_tensors(tensors) if tensors else b"")


def decode(text: str, blob: bytes):
    """The tree that :func:`encode` wrote."""
    tensors = load_tensors(blob) if blob else {}

    def walk(obj):
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if not isinstance(obj, dict):
            return obj
        if len(obj) == 1:
            (tag, value), = obj.items()
            if tag == "$t":
                return tensors[value]
            if tag == "$tu":
                return tuple(walk(v) for v in value)
            if tag == "$b":
                return base64.b64decode(value)
            if tag == "$m":
                return {_key(walk(k)): walk(v) for k, v in value}
            if tag == "$w":
                return wire.unpackb(base64.b64decode(value), wire.answer_limits(len(value)))
        return {k: walk(v) for k, v in obj.items()}

    return walk(json.loads(text))


def _key(k):
    return tuple(_key(v) for v in k) if isinstance(k, list) else k
