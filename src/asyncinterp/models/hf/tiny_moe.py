"""Tiny random mixture-of-experts language models (Mixtral, Qwen2-MoE, OLMoE), for tests, docs and benchmarks.

Built from a config in code, offline, with the bundled GPT-2 tokenizer of
:func:`~asyncinterp.models.hf.bundled.tiny_llama`. Weights are rescaled so
that routing is decisive and masking an expert changes the next token (the
default initialisation gives nearly flat logits). :func:`tiny_moe_dir` saves
one for vLLM.
"""

from __future__ import annotations

import os

import torch

__all__ = ["FAMILIES", "tiny_moe", "tiny_moe_dir"]

FAMILIES = ("mixtral", "qwen2_moe", "olmoe")


def _config(family: str, tok):
    import transformers as tf
    common = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256, num_experts_per_tok=2)
    if family == "mixtral":
        return tf.MixtralConfig(num_local_experts=4, head_dim=32, **common), tf.MixtralForCausalLM
    if family == "qwen2_moe":
        return (tf.Qwen2MoeConfig(num_experts=4, moe_intermediate_size=64, shared_expert_intermediate_size=128,
                                  norm_topk_prob=False, **common), tf.Qwen2MoeForCausalLM)
    if family == "olmoe":
        return tf.OlmoeConfig(num_experts=4, norm_topk_prob=True, **common), tf.OlmoeForCausalLM
    raise ValueError(f"unknown MoE family {family!r}; choose one of {FAMILIES}")


def tiny_moe(family: str = "mixtral", seed: int = 0):
    """``(model, tokenizer)``: a 2-layer, 4-expert, top-2 random MoE causal LM of ``family`` (eval mode)."""
    from .bundled import tiny_llama
    _, tok = tiny_llama()
    config, cls = _config(family, tok)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = cls(config).eval()
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            emb = model.model.embed_tokens.weight
            emb.copy_(torch.randn(emb.shape, generator=g))
            for layer in model.model.layers:
                moe = layer.mlp
                moe.gate.weight.copy_(torch.randn(moe.gate.weight.shape, generator=g) * 0.5)
                moe.experts.down_proj.mul_(20.0)
                layer.self_attn.o_proj.weight.mul_(5.0)
    return model, tok


def tiny_moe_dir(path, family: str = "mixtral", seed: int = 0) -> str:
    """:func:`tiny_moe` saved (safetensors + tokenizer) in ``path``, e.g. for ``ai.VLLM(path)``."""
    model, tok = tiny_moe(family, seed)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return str(path)
