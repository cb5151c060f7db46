"""Shared set-up for the vLLM tests: import vLLM (skip only if that fails), tiny model dirs, engine options."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20, seed=0)
PREFIX_BLOCK = 32   # the prefix cache's block size in the serving tests (prompts are written to span several)


def require_vllm():
    """Import vLLM, or skip the calling test/fixture saying why (the only reason these tests skip)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: not usable here
        pytest.skip(f"vLLM cannot be imported ({type(exc).__name__}: {exc}); install it with "
                    "scripts/install_vllm.sh .venv (make setup does)")


def make_tiny_dir(path, seed=0, **kwargs):
    """A tiny random Llama (head_dim 32) saved for vLLM, with weights scaled so that greedy decoding
    reacts to edits (the default init makes nearly flat logits)."""
    from asyncinterp.models.hf.bundled import tiny_llama
    model, tok = tiny_llama(seed=seed, **kwargs)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.copy_(torch.randn(emb.shape, generator=g))
        for layer in model.model.layers:
            for lin in (layer.mlp.down_proj, layer.self_attn.o_proj):
                lin.weight.mul_(5.0)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return str(path)


def hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The tiny Llama of make_tiny_dir (seed 0), saved once per test session (read-only for the tests)."""
    require_vllm()
    return make_tiny_dir(tmp_path_factory.mktemp("vllm-tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def engines(tiny_dir):
    """``(transformers LanguageModel, ai.VLLM)`` over the same tiny weights, one pair per test module."""
    import asyncinterp as ai
    vm = ai.VLLM(tiny_dir, **ENGINE)
    lm = ai.LanguageModel(hf_model(tiny_dir), vm.tokenizer)
    yield lm, vm
    vm.close()


def cli_engine(path, *flags):
    """``ai.VLLM`` over ``path`` as ``asyncinterp serve PATH --engine vllm`` builds it, with :data:`ENGINE`'s
    options as flags and ``flags`` added (e.g. ``--disable-log-stats``)."""
    import argparse

    from asyncinterp.serve.cli import build_model, configure
    p = argparse.ArgumentParser()
    configure(p)
    argv = [str(path), "--engine", "vllm", "--dtype", ENGINE["dtype"], "--max-model-len", str(ENGINE["max_model_len"]),
            "--kv-cache-memory-bytes", str(ENGINE["kv_cache_memory_bytes"]), "--seed", str(ENGINE["seed"]), *flags]
    return build_model(p.parse_args(argv))


@contextlib.contextmanager
def served_engine(model_dir, setup, **server_kwargs):
    """A prefix-caching tiny vLLM engine behind a real server on uvicorn: ``setup(server)`` registers what a
    test module needs before it starts serving; yields ``(engine, live)`` and closes both at the end."""
    import asyncinterp as ai
    from asyncinterp.serve import Server
    from remote_helpers import Live
    vm = ai.VLLM(model_dir, enable_prefix_caching=True, block_size=PREFIX_BLOCK, **ENGINE)
    try:
        server = Server(vm, **{"timeout": 60, "prompt_tokens_details": True, **server_kwargs})
        setup(server)
        live = Live(server)
        try:
            yield vm, live
        finally:
            live.close()
    finally:
        vm.close()
