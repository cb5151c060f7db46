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
``blocks.{i}.hook_attn_out``              ``layers[i].attn.output`` (its first element: the block's output)
``blocks.{i}.hook_mlp_out``               ``layers[i].mlp.output`` (its first element)
``blocks.{i}.mlp.hook_pre/post``          ``layers[i].mlp.pre/post``
``hook_embed`` / ``hook_pos_embed``       ``embed.output`` / ``pos_embed.output``
``ln_final``                              ``final_norm`` (standard name)
``ln_final.hook_normalized``              ``final_norm.output`` (its first element)
========================================  ==========================================================

Each name resolves to the same point object as the name it stands for (or,
for the ``*_out``, ``hook_embed`` and ``hook_normalized`` names, to a derived
view of a module's output point): correctness is that of the point behind it,
and awaiting it costs what awaiting that point costs. Like every standard
name they are looked up only when an envoy has no child or attribute of that
name (real names win: on a wrapped TransformerLens ``HookedTransformer`` the
``hook_*`` names are its own modules), made on first lookup and kept, and add
no hook and no per-call work to a model where they are not awaited.
"""

from __future__ import annotations

from .aliases import TL_MODULE_NAMES as MODULE_NAMES   # blocks -> layers, ln_final -> final_norm
from .aliases import real_or_alias
from .envoy import HookPoint, register_tl_names

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
POINT_NAMES = frozenset(_SEMANTIC) | frozenset(_LAYER_OUTPUTS) | frozenset(_ROOT_OUTPUTS) | {"hook_normalized"}
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


_child = real_or_alias   # the child of an envoy by real name, else by standard name; or None


def tl_point(envoy, name: str):
    """The point TransformerLens's hook name ``name`` stands for below ``envoy``, or ``None``."""
    semantic = _SEMANTIC.get(name)
    if semantic is not None:
        return envoy.standard_name(semantic)
    sub = _LAYER_OUTPUTS.get(name)
    if sub is not None:
        target = _child(envoy, sub)
        # a layer: it has both an attention block and an MLP (a bare attention or MLP module is not one)
        if target is None or _child(envoy, "mlp" if sub == "attn" else "attn") is None:
            return None
        return OutputPoint(envoy, name, target)
    sub = _ROOT_OUTPUTS.get(name)
    if sub is not None:
        if envoy.parent is not None:
            return None
        target = _child(envoy, sub)
        return None if target is None else OutputPoint(envoy, name, target)
    if name == "hook_normalized":
        final = _child(envoy.root, "final_norm")
        if final is None or final.module is not envoy.module:
            return None     # only the final norm (ln_final); the per-layer ln1/ln2 are not offered
        return OutputPoint(envoy, name, envoy)
    return None


register_tl_names(tl_point)
