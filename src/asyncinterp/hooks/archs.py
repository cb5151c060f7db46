"""The one table of architecture knowledge for semantic points on transformers models.

Most semantic points are read where the model itself computes them: the
residual stream is a layer's input and output, ``attn.z`` the input of the
attention's output projection, ``attn.pattern`` what transformers' attention
function receives (:mod:`asyncinterp.hooks.attention`), ``logits`` what the
model returns. Three things cannot be read off the module tree and are
stated here, once per architecture (``config.model_type``):

* where ``resid_mid`` lives: the input of which module (a norm the layer also
  keeps as the residual: ``post_attention_layernorm`` in Llama,
  ``pre_feedforward_layernorm`` in Gemma-2/3, the MLP itself in OLMo-2), or
  nowhere (parallel attention and MLP: GPT-J, Phi-1/2, Cohere, GPT-NeoX's
  default);
* how a fused q/k/v projection is laid out (GPT-2's equal thirds, GPT-BigCode's
  multi-query ``[q | k | v]``, GPT-NeoX's and BLOOM's per-head interleave...);
* what a point the architecture has but we cannot give yet is, and why
  (a refusal: a sentence that the error names, with the architecture).

An architecture not listed here gets only what needs no knowledge (resid_pre,
resid_post, z, pattern, logits, separate q/k/v projections, the MLP's
activation) plus ``resid_mid`` when the layer is plainly Llama-shaped; the
rest is refused as "not verified for this architecture", never guessed.
``tests/test_architectures.py`` checks every entry against the real
computation, and ``scripts/architectures_table.py`` writes docs/architectures.md
from that check.
"""

from __future__ import annotations

import inspect

from ..kernel.errors import AsyncInterpError

__all__ = ["ARCHS", "Refused", "PointUnavailableError", "facts", "arch_name", "resid_mid_site", "qkv_layout", "z_site", "mlp_refusal",
           "alias_override"]


class PointUnavailableError(AsyncInterpError):
    """A semantic point that this engine (or this architecture) cannot provide; the message says what to use."""


class Refused(str):
    """A reason why a point the architecture has (or lacks) is not given; the error message quotes it."""


_PARALLEL = Refused("attention and MLP run in parallel on the same normed input (x + attn(ln(x)) + mlp(ln(x))): "
                    "there is no residual stream between them. Use layers[i].resid_pre, layers[i].attn.output and "
                    "layers[i].mlp.output")
_SHARED_NORM = Refused("attention and MLP read the same normed input (layers[i].attn_norm): there is no separate "
                       "norm before the MLP")
_MLA = Refused("multi-head latent attention: q and k are assembled from compressed projections plus a separate "
               "rotary part, so there is no per-head q/k/v projection output to show. Use attn.pattern and attn.z "
               "(or the q_b_proj / kv_b_proj outputs)")

#: model_type -> facts. Keys (all optional):
#:   mid: name of the layer's child whose first input is resid_mid | "mlp" (the MLP takes it directly) |
#:        ("parallel_if", config attribute) (parallel when true, else the "norm" given) | a Refused
#:   norm: the child for ("parallel_if", ...) when not parallel
#:   qkv: (layout, fused child of the attention) | a Refused; absent: q_proj / k_proj / v_proj
#:   z: for blocks that do not call transformers' attention interface: the child whose input is z
#:   mlp_norm: what the standard name layers[i].mlp_norm means (a child name, or a Refused)
#:   mlp: a Refused for mlp.pre / mlp.post
_LLAMA: dict = {"mid": "post_attention_layernorm"}
_GEMMA2 = {"mid": "pre_feedforward_layernorm", "mlp_norm": "pre_feedforward_layernorm"}
_POST_NORM = {"mid": "mlp", "mlp_norm": Refused(
    "this architecture has no norm before the MLP (it normalises the attention and MLP outputs instead: "
    "post_attention_layernorm, post_feedforward_layernorm); the MLP's input is the residual stream, "
    "layers[i].resid_mid")}

ARCHS: dict[str, dict] = {
    **{name: _LLAMA for name in (
        "llama", "mistral", "qwen2", "qwen3", "granite", "smollm3", "olmo", "helium", "arcee",
        "seed_oss", "ministral", "ernie4_5", "hunyuan_v1_dense", "nemotron", "starcoder2", "gemma", "glm4",
        "qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "granitemoe", "phimoe", "gpt_oss", "llama4_text",
        "cwm", "ernie4_5_moe", "exaone_moe", "glm4_moe", "granite_swa", "jais2", "laguna", "mellum", "minimax_m2",
        "ministral3", "solar_open", "hy_v3", "mimo_v2_flash", "diffllama")},
    "apertus": {"mid": "feedforward_layernorm", "mlp_norm": "feedforward_layernorm"},
    "gemma2": _GEMMA2, "gemma3_text": _GEMMA2, "vaultgemma": {"mid": "pre_feedforward_layernorm"},
    "olmo2": _POST_NORM, "olmo3": _POST_NORM, "exaone4": _POST_NORM,
    "phi3": {"mid": "post_attention_layernorm", "qkv": ("blocks", "qkv_proj")},
    "glm": {"mid": "post_attention_layernorm"},
    "deepseek_v2": {"mid": "post_attention_layernorm", "qkv": _MLA},
    "deepseek_v3": {"mid": "post_attention_layernorm", "qkv": _MLA},
    "gpt2": {"mid": "ln_2", "qkv": ("blocks", "c_attn")},
    "gpt_bigcode": {"mid": "ln_2", "qkv": ("bigcode", "c_attn")},
    "gpt_neox": {"mid": ("parallel_if", "use_parallel_residual"), "norm": "post_attention_layernorm",
                 "qkv": ("per_head", "query_key_value")},
    "stablelm": {"mid": ("parallel_if", "use_parallel_residual"), "norm": "post_attention_layernorm"},
    "falcon": {"mid": ("parallel_if", "falcon_parallel"), "norm": "post_attention_layernorm",
               "qkv": ("falcon", "query_key_value"), "z": "dense"},
    "bloom": {"mid": "post_attention_layernorm", "qkv": ("per_head", "query_key_value"), "z": "dense"},
    "mpt": {"mid": "norm_2", "mlp_norm": "norm_2", "qkv": ("blocks_equal", "Wqkv"), "z": "out_proj"},
    "gptj": {"mid": _PARALLEL, "z": "out_proj", "mlp_norm": _SHARED_NORM},
    "phi": {"mid": _PARALLEL, "mlp_norm": _SHARED_NORM}, "cohere": {"mid": _PARALLEL, "mlp_norm": _SHARED_NORM},
    "cohere2": {"mid": _PARALLEL, "mlp_norm": _SHARED_NORM},
    "opt": {"mid": Refused("OPT flattens the stream to [b*n, d] before its MLP norm (final_layer_norm), so that "
                           "input is not per batch row; use layers[i].resid_pre + layers[i].attn.output "
                           "(or layers[i].resid_post - the fc2 output)"),
            "mlp": Refused("OPT has no MLP module: fc1, activation_fn and fc2 sit on the layer and see the stream "
                           "flattened to [b*n, d]; use layers[i].fc1.output / layers[i].fc2.input (flat rows)")},
    "bitnet": {"mid": "post_attention_layernorm"},
}

_LLAMA_SHAPE = {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}


def arch_name(envoy) -> str:
    """``config.model_type`` of the wrapped model ``envoy`` belongs to (``"?"`` when it has none)."""
    cfg = getattr(envoy.root.module, "config", None)
    return str(getattr(cfg, "model_type", "?"))


def facts(envoy) -> dict | None:
    """The table's entry for the architecture of ``envoy``'s model, or ``None`` when it is not listed."""
    return ARCHS.get(arch_name(envoy))


def _config(envoy):
    return getattr(envoy.root.module, "config", None)


def resid_mid_site(layer, children: dict):
    """Where ``resid_mid`` is read in ``layer``: a child name whose first input it is, or a :class:`Refused`."""
    entry = facts(layer)
    if entry is None:
        names = set(children)
        if (_LLAMA_SHAPE <= names and not any("norm" in n for n in names - _LLAMA_SHAPE)
                and _adds_before_norm(type(layer.module))):
            return "post_attention_layernorm"
        return Refused(f"the residual layout of architecture {arch_name(layer)!r} is not verified (not in "
                       "asyncinterp.hooks.archs.ARCHS), so resid_mid is not guessed; use layers[i].resid_pre, "
                       ".attn.output and .resid_post")
    mid = entry.get("mid")
    if isinstance(mid, tuple):
        cfg = _config(layer)
        parallel = _falcon_parallel(cfg) if mid[1] == "falcon_parallel" else bool(getattr(cfg, mid[1], False))
        return _PARALLEL if parallel else entry["norm"]
    return mid


def _adds_before_norm(cls) -> bool:
    """Whether ``cls.forward`` adds the attention output to the residual before ``post_attention_layernorm``.

    The Llama order (``h = residual + h; residual = h; h = self.post_attention_layernorm(h)``), read from the
    source of a layer class that is not in the table: a post-norm layer (the norm applied to the attention
    output before the add, as OLMo-2 does) fails it, and its resid_mid is refused instead of guessed.
    """
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    attn = src.find("self.self_attn(")
    norm = src.find("self.post_attention_layernorm(", attn)
    adds = [i for i in (src.find("residual + hidden_states", attn), src.find("hidden_states + residual", attn))
            if i >= 0]
    return attn >= 0 and norm >= 0 and bool(adds) and min(adds) < norm


def _falcon_parallel(cfg) -> bool:
    return bool(getattr(cfg, "new_decoder_architecture", False) or getattr(cfg, "parallel_attn", False))


def qkv_layout(attn):
    """How q/k/v are laid out in ``attn``: ``None`` (separate projections), ``(layout, fused child)``, or a Refused."""
    entry = facts(attn) or {}
    layout = entry.get("qkv")
    if layout is not None and not isinstance(layout, Refused) and layout[0] == "falcon":
        if getattr(_config(attn), "new_decoder_architecture", False):
            return Refused("Falcon's new decoder architecture groups q heads with their k/v head in the fused "
                           "projection, so q is not a view of it; use attn.pattern / attn.z or "
                           "query_key_value.output")
    return layout


def z_site(attn) -> str | None:
    """The attention child whose input is ``attn.z``, for blocks without the attention interface (else ``None``)."""
    return (facts(attn) or {}).get("z")


def mlp_refusal(layer_or_mlp):
    return (facts(layer_or_mlp) or {}).get("mlp")


#: model-level standard names whose module does not compute what the name says, by architecture
_MODEL_NAMES = {
    "nanochat": {"final_norm": Refused(
        "nanochat calls its norm module (model.norm) twice in a forward, after the embedding and before lm_head, "
        "so its .output would be the first call, not the final norm; read lm_head.input (or model.norm.output's "
        "second call)")},
}


def alias_override(envoy, name: str):
    """What the table says standard name ``name`` means on ``envoy`` (a child name or a Refused), or ``None``."""
    said = _MODEL_NAMES.get(arch_name(envoy), {}).get(name)
    if said is not None:
        return said
    entry = facts(envoy)
    if not entry:
        return None
    return entry.get(name)
