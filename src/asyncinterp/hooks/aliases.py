"""Standard names: one intervention for GPT-2, Llama and similar families.

Architectures name the same parts differently (``transformer.h`` vs
``model.layers``, ``attn`` vs ``self_attn``, ``ln_f`` vs ``model.norm``).
Every envoy also answers to standard names, resolved to the real module::

    async def portable(m):
        h = await m.layers[3].output          # transformer.h.3 / model.layers.3
        a = await m.layers[3].attn.output     # .attn / .self_attn
        return await m.lm_head.output

Standard names (on the model): ``layers``, ``embed``, ``pos_embed``,
``final_norm``, ``lm_head``; (on a layer): ``attn``, ``mlp``, ``attn_norm``,
``mlp_norm``; (on an attention block): ``out_proj``; (on an MLP):
``up_proj``, ``down_proj``. The envoy returned is the real one (its
``.path`` and error messages use the real path), so awaiting
``m.layers[3].attn.output`` and ``m.transformer.h[3].attn.output`` is the
same hook point.

Real names always win: an alias is only looked up when an envoy has no
child or attribute of that name, so existing code pays nothing. Add names for
other architectures with :func:`register` (for all models) or
:func:`set_alias` (for one wrapped model).
"""

from __future__ import annotations

import weakref

from .archs import Refused, alias_override
from .modules import submodules

__all__ = ["STANDARD", "register", "set_alias", "aliases_of", "copy_aliases", "resolve", "standard_names",
           "real_or_alias", "lookup"]

# standard name -> candidate relative paths, tried in order
STANDARD: dict[str, list[str]] = {
    # model level
    "layers": ["model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers", "transformer.layers",
               "transformer.blocks", "h", "blocks"],
    "embed": ["model.embed_tokens", "transformer.wte", "gpt_neox.embed_in", "model.decoder.embed_tokens",
              "transformer.word_embeddings", "embed_tokens", "wte"],
    "pos_embed": ["transformer.wpe", "model.decoder.embed_positions", "wpe"],
    "final_norm": ["model.norm", "transformer.ln_f", "gpt_neox.final_layer_norm", "model.decoder.final_layer_norm",
                   "transformer.norm_f", "model.final_layernorm", "norm", "ln_f"],
    "lm_head": ["lm_head", "embed_out"],
    # layer level
    "attn": ["self_attn", "attn", "attention", "self_attention"],
    "mlp": ["mlp", "feed_forward", "ffn"],
    "attn_norm": ["input_layernorm", "ln_1", "norm_1", "self_attn_layer_norm", "attention_layernorm"],
    "mlp_norm": ["post_attention_layernorm", "ln_2"],   # (where that is not the pre-MLP norm: hooks/archs.py)
    # attention / MLP level
    "out_proj": ["o_proj", "c_proj", "dense"],
    "up_proj": ["c_fc", "fc1", "fc_in", "dense_h_to_4h"],
    "down_proj": ["c_proj", "fc2", "fc_out", "dense_4h_to_h"],
}


_BY_ARCHITECTURE = frozenset(("mlp_norm", "mlp", "final_norm"))


def register(name: str, *paths: str) -> None:
    """Add candidate paths for a standard (or new) name, for every model (tried after the built-in ones)."""
    STANDARD.setdefault(name, [])
    for p in paths:
        if p not in STANDARD[name]:
            STANDARD[name].append(p)


# root envoy -> {name: path}: the names set with set_alias on that wrapped model only
_overrides: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def set_alias(model, name: str, path: str) -> None:
    """Make ``name`` resolve to ``path`` (relative to the root) on this wrapped model only."""
    root = model.root
    if _lookup(root, path) is None:
        raise ValueError(f"{path!r} is not a module path of this model")
    _overrides.setdefault(root, {})[name] = path
    root.forget_name(name)   # the root may have kept what the name meant before


def aliases_of(model) -> dict:
    """``{name: path}`` set with :func:`set_alias` on this wrapped model (a copy)."""
    return dict(_overrides.get(model.root, {}))


def copy_aliases(source, target) -> None:
    """Give wrapped model ``target`` the per-model aliases of ``source`` (e.g. a copy made by ``model.edit``)."""
    found = _overrides.get(source.root)
    if found:
        _overrides[target.root] = dict(found)


def _lookup(envoy, path: str):
    e = envoy
    for part in path.split("."):
        if part not in submodules(e.module):
            return None
        e = e.child(part)
    return e


def resolve(envoy, name: str):
    """The envoy that standard name ``name`` means below ``envoy``, or ``None``."""
    lens = TL_MODULE_NAMES.get(name)      # TransformerLens's ``blocks``, ``ln_final``: our standard names
    if lens is not None and not (_overrides and name in _overrides.get(envoy, {})):
        return real_or_alias(envoy, lens)
    if _overrides and envoy.parent is None:
        override = _overrides.get(envoy, {}).get(name)
        if override is not None:
            return _lookup(envoy, override)
    if name in _BY_ARCHITECTURE:                 # names whose meaning differs by architecture (hooks/archs.py)
        said = alias_override(envoy, name)
        if isinstance(said, Refused):
            return None                          # Envoy._missing quotes the reason
        if said is not None:
            return _lookup(envoy, said)
    candidates = STANDARD.get(name)
    if not candidates:
        return None
    for path in candidates:
        if path == name:
            continue
        found = _lookup(envoy, path)
        if found is not None:
            return found
    return None


def standard_names(model) -> dict:
    """``{standard name: real path}`` for the model level and for its first layer (``layers.0.*``)."""
    out = {}
    root = model.root
    for name in ("layers", "embed", "pos_embed", "final_norm", "lm_head"):
        e = real_or_alias(root, name)
        if e is not None:
            out[name] = e.path
    layers = real_or_alias(root, "layers")
    if layers is not None and len(layers):
        layer = layers[0]
        for name in ("attn", "mlp", "attn_norm", "mlp_norm"):
            e = real_or_alias(layer, name)
            if e is not None:
                out[f"layers.0.{name}"] = e.path
                for sub in ("out_proj", "up_proj", "down_proj"):
                    if (name == "attn") == (sub == "out_proj"):
                        s = real_or_alias(e, sub)
                        if s is not None:
                            out[f"layers.0.{name}.{sub}"] = s.path
    return out


#: TransformerLens's module names -> our standard names (its point names: asyncinterp.hooks.tl_names)
TL_MODULE_NAMES: dict[str, str] = {"blocks": "layers", "ln_final": "final_norm"}


def real_or_alias(envoy, name):
    """The child ``name`` of ``envoy``: a real submodule, else what the standard name means; or ``None``."""
    if name in submodules(envoy.module):
        return envoy.child(name)
    return resolve(envoy, name)


def lookup(envoy, path: str):
    """The envoy or point that dotted ``path`` names below ``envoy`` (what ``envoy.at(path)`` returns).

    Each part is what attribute access gives (``getattr(e, part)``): real
    module names, standard names, semantic points, TransformerLens's names
    and ``output``/``inputs``/``input``; a part of digits is a submodule by
    name (``layers.3``). So a cache key (``model.layers.3.output``), a module
    path, and a TransformerLens hook name (``blocks.3.hook_resid_post``, as
    SAELens stores it in ``sae.cfg.metadata.hook_name``) all work. A last
    part named ``hook_*`` that is a real module (a wrapped TransformerLens
    model's ``HookPoint``) gives that module's ``.output``: a hook name
    always names a value.
    """
    from ..kernel.errors import ModulePathError
    from .points import Point
    if not isinstance(path, str) or not path:
        raise TypeError(f"a point path is a non-empty dotted string, got {path!r}")
    here = envoy
    done = []
    for part in path.split("."):
        if isinstance(here, Point):
            raise ModulePathError(f"{'.'.join(done)} in {path!r} is a hook point; it has nothing named {part!r}")
        here = getattr(here, part)
        done.append(part)
    if not isinstance(here, Point) and done[-1].startswith("hook_") and hasattr(here, "output"):
        here = here.output
    return here
