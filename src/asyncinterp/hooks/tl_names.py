"""TransformerLens's hook names (``blocks.3.hook_resid_post``) as aliases of our points.

Why this module exists: SAEs, transcoders and probes trained with
TransformerLens or SAELens name the activation they read by TransformerLens's
hook name (a SAELens SAE carries it in ``sae.cfg.metadata.hook_name``). With
these names resolved onto our own points, such an artefact attaches by the
string in its own config, on any model with semantic points (transformers
and vLLM alike)::

    h = await m.blocks[3].hook_resid_post            # = m.layers[3].resid_post, the same point
    h = await m.at("blocks.3.attn.hook_z")           # = m.layers[3].attn.z
    h = await m.at(sae.cfg.metadata.hook_name)

The names and what they stand for:

========================================  ==========================================================
TransformerLens                           asyncinterp
========================================  ==========================================================
``blocks``                                ``layers`` (standard name)
``blocks.{i}.hook_resid_pre/mid/post``    ``layers[i].resid_pre/mid/post``
``blocks.{i}.attn.hook_q/k/v/z/pattern``  ``layers[i].attn.q/k/v/z/pattern``
``blocks.{i}.hook_attn_out``              what attention adds to the residual: ``layers[i].attn.output``
                                          (first element), or the norm of it (sandwich norms: Gemma-2/3)
``blocks.{i}.hook_mlp_out``               what the MLP adds: ``layers[i].mlp.output``, or its norm
``blocks.{i}.mlp.hook_pre/post``          ``layers[i].mlp.pre/post``
``blocks.{i}.mlp.hook_pre_linear``        a gated MLP's ``up_proj`` output (``hook_pre`` is the gate's)
``hook_embed`` / ``hook_pos_embed``       ``embed.output`` / ``pos_embed.output``
``ln_final``                              ``final_norm`` (standard name)
``ln_final.hook_normalized``              the final norm's input normalised, before its weight and bias
                                          (as TransformerLens hooks it); read-only
========================================  ==========================================================

Each name resolves to the same point object as the name it stands for (or,
for the ``*_out``, ``hook_embed`` and ``hook_normalized`` names, to a derived
view of a module's output or input point): correctness is that of the point behind it,
and awaiting it costs what awaiting that point costs. Like every standard
name they are looked up only when an envoy has no child or attribute of that
name (real names win: on a wrapped TransformerLens ``HookedTransformer`` the
``hook_*`` names are its own modules), made on first lookup and kept, and add
no hook and no per-call work to a model where they are not awaited.
"""

from __future__ import annotations

import inspect

import torch

from ..kernel.errors import ReplacementError
from .aliases import TL_MODULE_NAMES as MODULE_NAMES   # blocks -> layers, ln_final -> final_norm
from .aliases import real_or_alias
from .envoy import HookPoint, register_tl_names
from .modules import submodules
from .semantic import UnavailablePoint

__all__ = ["MODULE_NAMES", "POINT_NAMES", "NAMES", "tl_point"]

#: hook names that are one of our semantic points on the same envoy
_SEMANTIC = {
    "hook_resid_pre": "resid_pre", "hook_resid_mid": "resid_mid", "hook_resid_post": "resid_post",   # a layer
    "hook_q": "q", "hook_k": "k", "hook_v": "v", "hook_z": "z", "hook_pattern": "pattern",            # attention
    "hook_pre": "pre", "hook_post": "post",                                                           # an MLP
}
#: hook names on a layer that are a sub-block's output (its first element)
_LAYER_OUTPUTS = {"hook_attn_out": "attn", "hook_mlp_out": "mlp"}
#: hook names on the model that are a module's output
_ROOT_OUTPUTS = {"hook_embed": "embed", "hook_pos_embed": "pos_embed"}

#: every TransformerLens point name this module resolves
POINT_NAMES = frozenset(_SEMANTIC) | frozenset(_LAYER_OUTPUTS) | frozenset(_ROOT_OUTPUTS) | {"hook_normalized",
                                                                                         "hook_pre_linear"}
#: every TransformerLens name (modules and points)
NAMES = POINT_NAMES | frozenset(MODULE_NAMES)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _with_first(new, out):
    return (new,) + tuple(out[1:]) if isinstance(out, tuple) else new


class OutputPoint(HookPoint):
    """A module's output (its first element when it returns a tuple), shown under a TransformerLens name."""

    __slots__ = ("label",)

    def __init__(self, owner, name: str, module_envoy):
        base = module_envoy.output
        HookPoint.__init__(self, module_envoy, name, base, _first, _with_first)
        self.label = f"{owner.path}.{name}" if owner.path else name

    def describe(self) -> str:
        return self.label


# sandwich norms (Gemma-2/3, OLMo-2/3, EXAONE-4, GLM-4, AFMoE): a norm applied to a branch's output before the add
_POST_MLP_NORMS = ("post_feedforward_layernorm", "post_mlp_layernorm")
_POST_ATTN_NORMS = ("post_self_attn_layernorm", "post_attention_layernorm")
_PRE_MLP_NORMS = ("pre_feedforward_layernorm", "pre_mlp_layernorm")


def _contribution(layer, sub, branch):
    """``(envoy, None)``: the module whose output is what branch ``sub`` adds to the residual stream
    (TransformerLens's ``hook_attn_out`` / ``hook_mlp_out``), or ``(None, why)`` when it cannot be told.

    The branch itself, unless the layer normalises the branch's output before adding it (sandwich norms):
    then that norm. ``post_attention_layernorm`` is the pre-MLP norm in Llama-style layers and the norm of
    the attention output in sandwich layers, so it is taken for the latter only when the layer's other
    norms leave no doubt (a separate pre-MLP norm, or no pre-norms at all).
    """
    if "residual" in _parameters(branch.module):
        return None, (f"{type(branch.module).__name__} adds the residual inside its own forward (it takes "
                      "`residual`), so its output is not what it adds to the residual stream; read the layer's "
                      "resid_pre / resid_mid / resid_post instead")
    subs = submodules(layer.module)
    post_mlp = next((n for n in _POST_MLP_NORMS if n in subs), None)
    if post_mlp is None:
        return branch, None
    if sub == "mlp":
        return layer.child(post_mlp), None
    if "post_self_attn_layernorm" in subs:
        return layer.child("post_self_attn_layernorm"), None
    if "post_attention_layernorm" in subs and (
            any(n in subs for n in _PRE_MLP_NORMS) or "input_layernorm" not in subs):
        return layer.child("post_attention_layernorm"), None
    return None, (f"{type(layer.module).__name__} normalises its MLP output before adding it "
                  f"({post_mlp}), but which norm (if any) it applies to the attention output cannot be told "
                  "from its module names; read the layer's resid_pre and resid_mid instead")


def _parameters(module):
    try:
        return inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return {}


def tl_point(envoy, name: str):
    """The point TransformerLens's hook name ``name`` stands for below ``envoy``, or ``None``."""
    semantic = _SEMANTIC.get(name)
    if semantic is not None:
        return envoy.standard_name(semantic)
    sub = _LAYER_OUTPUTS.get(name)
    if sub is not None:
        branch = real_or_alias(envoy, sub)
        # a layer: it has both an attention block and an MLP (a bare attention or MLP module is not one)
        if branch is None or real_or_alias(envoy, "mlp" if sub == "attn" else "attn") is None:
            return None
        target, why = _contribution(envoy, sub, branch)
        if target is None:
            return UnavailablePoint(f"{envoy.path}.{name}", why)
        return OutputPoint(envoy, name, target)
    sub = _ROOT_OUTPUTS.get(name)
    if sub is not None:
        if envoy.parent is not None:
            return None
        target = real_or_alias(envoy, sub)
        return None if target is None else OutputPoint(envoy, name, target)
    if name == "hook_pre_linear":       # a gated MLP's linear branch (up_proj), beside hook_pre (the gate's)
        subs = submodules(envoy.module)
        if "gate_proj" in subs and "up_proj" in subs:
            return OutputPoint(envoy, name, envoy.child("up_proj"))
        return None
    if name == "hook_normalized":
        final = real_or_alias(envoy.root, "final_norm")
        if final is None or final.module is not envoy.module:
            return None     # only the final norm (ln_final); the per-layer ln1/ln2 are not offered
        return _normalized(envoy)
    return None


def _read_only_normalized(new, value):
    raise ReplacementError("ln_final.hook_normalized is read-only: it is computed from the final norm's input "
                           "(the norm itself applies its weight to it at once). Replace ln_final's output "
                           "(m.final_norm.output) or its input instead")


def _normalized(envoy):
    """``hook_normalized`` of a norm: its input normalised, without the weight and bias (TransformerLens's
    ``x / scale``), from the norm's input point; a norm of another kind is refused."""
    module = envoy.module
    label = f"{envoy.path}.hook_normalized"
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if isinstance(module, torch.nn.LayerNorm):
        shape = tuple(module.normalized_shape)

        def norm(x):
            return torch.nn.functional.layer_norm(x.float(), shape, eps=module.eps)
    elif type(module).__name__.endswith("RMSNorm") and isinstance(eps, float):
        def norm(x):
            x = x.float()
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    else:
        return UnavailablePoint(label, f"{type(module).__name__} is not a LayerNorm or an RMSNorm whose "
                                "normalisation asyncinterp can recompute; read ln_final's output "
                                "(m.final_norm.output) instead")

    def read(inputs):
        args, kwargs = inputs
        x = args[0] if args else next(iter(kwargs.values()))
        residual = args[1] if len(args) > 1 else kwargs.get("residual")
        if isinstance(residual, torch.Tensor):     # vLLM's fused add + norm: it normalises x + residual
            x = x + residual
        return norm(x).to(x.dtype)

    point = OutputPoint.__new__(OutputPoint)
    HookPoint.__init__(point, envoy, "hook_normalized", envoy.inputs, read, _read_only_normalized)
    point.label = label
    return point


register_tl_names(tl_point)
