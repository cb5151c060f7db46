"""Semantic points: TransformerLens's names for the same values on every engine.

::

    async def fn(m):
        h = await m.layers[3].resid_mid          # residual stream after attention, before the MLP
        q = await m.layers[3].attn.q             # [b, n, heads, d_head], before q/k norms and rotary
        p = await m.layers[3].attn.pattern       # [b, heads, n, n_ctx] attention probabilities
        z = await m.layers[3].attn.z             # [b, n, heads, d_head], each head's output (TransformerLens hook_z)
        a = await m.layers[3].mlp.post           # the MLP's activation (input of its down projection)
        return await m.logits                    # [b, vocab] the logits the model returns (after any soft-cap)

Every semantic point is read where the model computes it: a derived view of
one real module hook point (``resid_post`` *is* the layer's output hook,
``attn.q`` the q projection's output per head), the attention function the
block calls (``pattern``, ``z``: :mod:`.attention`) or the model's returned
logits. What cannot be read off the module tree (where ``resid_mid`` is, how a
fused q/k/v projection is laid out, what is not given and why) is stated once
per architecture in :mod:`.archs`. A point is built the first time it is
looked up and adds no hook, attribute or per-call work to a model where it is
not awaited. Names are looked up only when an envoy has no child or attribute
of that name (real names win), after the standard names of
:mod:`asyncinterp.hooks.aliases`. A point the architecture lacks, or that is
not given yet, is an :class:`UnavailablePoint`: awaiting it raises
:class:`PointUnavailableError` naming the architecture and the reason.

Transformers models are handled here (docs/architectures.md lists every
architecture checked); other engines (vLLM) give their root envoy a
``build_semantic_point`` method.
"""

from __future__ import annotations

import torch

from ..kernel.errors import AsyncInterpError, ReplacementError
from .archs import PointUnavailableError, Refused, arch_name, facts, mlp_refusal, qkv_layout, resid_mid_site, z_site
from .attention import PatternPoint, ZPoint, interface_calls, out_projection, uses_interface
from .envoy import SEMANTIC_NAMES, HookPoint, register_semantic
from .moe import MOE_NAMES, moe_point
from .modules import add_forward_hook, submodules
from .points import Point
from .views import check_replacement

__all__ = ["NAMES", "SemanticPoint", "PatternPoint", "UnavailablePoint", "PointUnavailableError",
           "transformers_point", "LogitsPoint", "FusedPart"]

#: the semantic names, by the kind of envoy they live on
LAYER_NAMES = ("resid_pre", "resid_mid", "resid_post")
ATTN_NAMES = ("q", "k", "v", "z", "pattern")
MLP_NAMES = ("pre", "post")
ROOT_NAMES = ("logits",)
NAMES = frozenset(LAYER_NAMES + ATTN_NAMES + MLP_NAMES + ROOT_NAMES + MOE_NAMES)
assert NAMES == SEMANTIC_NAMES


class SemanticPoint(HookPoint):
    """A derived view of a real module hook point, shown under its semantic name (``model.layers.3.resid_mid``)."""

    __slots__ = ("label",)

    def __init__(self, owner, label: str, base, read=None, write=None):
        HookPoint.__init__(self, base.envoy, base.name, base, read, write)
        self.name = label
        self.label = f"{owner.path}.{label}" if owner.path else label

    def describe(self) -> str:
        return self.label


class UnavailablePoint(Point):
    """A semantic point that cannot fire here: awaiting it raises :class:`PointUnavailableError` at once."""

    __slots__ = ("label", "message")
    kind_label = "semantic points"

    def __init__(self, label: str, message: str):
        self.key, self.read, self.write, self.gradient = self, None, None, None
        self.label = label
        self.message = message

    def describe(self) -> str:
        return self.label

    def activate_in(self, run, task) -> None:
        raise PointUnavailableError(f"{self.label} is not available here: {self.message}")


# ----------------------------------------------------------------------------- small read/write helpers


def first_arg(inputs):
    args, kwargs = inputs
    if args:
        return args[0]
    return next(iter(kwargs.values()))


def with_first_arg(new, inputs):
    args, kwargs = inputs
    if args:
        return (new,) + tuple(args[1:]), kwargs
    key = next(iter(kwargs))
    return args, {**kwargs, key: new}


def first_of(out):
    return out[0] if isinstance(out, tuple) else out


def with_first(new, out):
    return (new,) + tuple(out[1:]) if isinstance(out, tuple) else new


def copy_into_first_arg(label):
    """Write for a point whose input tensor is also kept by the caller (``residual = h; h = norm(h)``).

    A replacement is copied *into* the tensor the module was called with, so
    every holder of it (the residual branch too) continues with the new value.
    """
    def write(new, inputs):
        old = first_arg(inputs)
        check_replacement(label, new, old)
        old.copy_(new)
        return inputs
    return write


def heads_view(head_dim: int):
    def read(t):
        t = first_of(t)
        return t.view(*t.shape[:-1], -1, head_dim)
    return read


def heads_write(new, out):
    old = first_of(out)
    return with_first(new.reshape(old.shape), out)


def slice_heads(start: int, stop: int, head_dim: int):
    """Read/write of heads stored in columns ``start:stop`` of a fused projection's output."""
    def read(out):
        t = first_of(out)[..., start:stop]
        return t.view(*t.shape[:-1], -1, head_dim)

    def write(new, out):
        old = first_of(out)
        part = old[..., start:stop]
        new = new.reshape(*part.shape[:-1], -1).reshape(part.shape) if isinstance(new, torch.Tensor) else new
        if not isinstance(new, torch.Tensor):
            raise ReplacementError(f"replacement must be a tensor, got {type(new).__name__}")
        full = old.clone()
        full[..., start:stop] = new
        return with_first(full, out)
    return read, write


def last_position(out):
    return first_of(out)[:, -1]


def with_last_position(new, out):
    old = first_of(out)
    check_replacement("logits", new, old[:, -1])
    full = old.clone()
    full[:, -1] = new
    return with_first(full, out)


# ----------------------------------------------------------------------------- transformers


def _find(envoy, *names):
    """The first child (real name, or standard name) of ``envoy`` among ``names``, or ``None``."""
    from .aliases import resolve
    subs = submodules(envoy.module)
    for name in names:
        if name in subs:
            return envoy.child(name)
    for name in names:
        try:
            found = resolve(envoy, name)
        except AsyncInterpError:
            found = None
        if found is not None:
            return found
    return None


_ACT_NAMES = ("act_fn", "act", "activation_fn", "activation", "act_func", "gelu_impl")
_MLP_OUT = ("down_proj", "c_proj", "fc2", "fc_out", "dense_4h_to_h", "w2")


def _unavailable(envoy, name, reason):
    return UnavailablePoint(f"{envoy.path}.{name}", f"architecture {arch_name(envoy)!r}: {reason}")


def _role(envoy):
    """``"layer"``, ``"attn"``, ``"mlp"`` or ``None``: what ``envoy`` is in a decoder (by its parent's standard names)."""
    parent = envoy.parent
    if parent is not None and _find(parent, "attn") is envoy and (
            _find(parent, "mlp") is not None or mlp_refusal(parent) is not None):
        return "attn"
    if parent is not None and _find(parent, "mlp") is envoy and _find(parent, "attn") is not None:
        return "mlp"
    if _find(envoy, "attn") is not None and (_find(envoy, "mlp") is not None or mlp_refusal(envoy) is not None):
        return "layer"
    return None


def transformers_point(envoy, name: str):
    """The semantic point ``name`` of ``envoy`` on a transformers model, or ``None`` (see :mod:`.archs`)."""
    if name == "logits":
        return _logits_point(envoy) if envoy.parent is None else None
    role = _role(envoy)
    if name in MOE_NAMES:
        made = moe_point(envoy, name)
        if made is None and role == "mlp" and "experts" in submodules(envoy.module):
            return _unavailable(envoy, name, f"the router of this MoE block ({type(envoy.module).__name__}) is not "
                                "a softmax top-k router the MoE points know; use its router/gate and experts "
                                "modules' .output")
        return made
    if name in LAYER_NAMES and role == "layer":
        return _layer_point(envoy, name)
    if name in ATTN_NAMES and role == "attn":
        return _attn_point(envoy, name)
    if name in MLP_NAMES and role == "mlp":
        return _mlp_point(envoy, name)
    return None


def _layer_point(layer, name):
    if name == "resid_pre":
        return SemanticPoint(layer, name, layer.inputs, first_arg, with_first_arg)
    if name == "resid_post":
        return SemanticPoint(layer, name, layer.output, first_of, with_first)
    site = resid_mid_site(layer, submodules(layer.module))
    if isinstance(site, Refused):
        return _unavailable(layer, name, site)
    target = _find(layer, "mlp") if site == "mlp" else layer.child(site)
    label = f"{layer.path}.resid_mid"
    return SemanticPoint(layer, name, target.inputs, first_arg, copy_into_first_arg(label))


def _heads(module):
    cfg = getattr(module, "config", None) or {}
    return int(getattr(cfg, "num_attention_heads", 0) or getattr(module, "num_heads", 0))


def _attn_point(attn, name):
    if name in ("z", "pattern") and uses_interface(attn.module) and interface_calls(attn.module) > 1:
        return _unavailable(attn, name, f"{type(attn.module).__name__} calls the attention function "
                            f"{interface_calls(attn.module)} times per call (differential attention), so there is "
                            "no single attention output or pattern per head; read its submodules' outputs")
    if name == "pattern":
        before = out_projection(attn) if uses_interface(attn.module) else None
        return PatternPoint(attn, before, arch_name(attn))
    if name == "z":
        site = z_site(attn)
        if site is None and uses_interface(attn.module):
            return ZPoint(attn, out_projection(attn))
        if site is None and facts(attn) is None:
            return _unavailable(attn, name, "this attention block does not use transformers' attention interface "
                                "and its output projection is not verified in asyncinterp.hooks.archs; use the "
                                "output projection's .input")
        out = attn.child(site) if site else out_projection(attn)
        heads = _heads(attn.root.module)
        if out is None or not heads:
            return _unavailable(attn, name, "no output projection (o_proj / c_proj / dense / out_proj) found in the "
                                "attention block; use the attention block's .output")
        return SemanticPoint(attn, name, out.inputs, heads_in(heads), heads_in_write)
    layout = qkv_layout(attn)
    if isinstance(layout, Refused):
        return _unavailable(attn, name, layout)
    subs = submodules(attn.module)
    hd = _head_dim(attn.module)
    if layout is None:
        proj = f"{name}_proj"
        if proj not in subs:
            return _unavailable(attn, name, f"no {proj} in {type(attn.module).__name__} and no fused q/k/v layout in "
                                "asyncinterp.hooks.archs for this architecture; use attn.pattern / attn.z")
        return SemanticPoint(attn, name, attn.child(proj).output, heads_view(hd), heads_write)
    kind, fused = layout
    fused_envoy = attn.child(fused)
    heads = _heads(attn.root.module)
    cfg = attn.root.module.config
    i = "qkv".index(name)
    if kind == "bigcode" and not getattr(cfg, "multi_query", True):
        kind = "per_head"
    if kind == "falcon":
        kind = "falcon_mq" if getattr(cfg, "multi_query", False) else "per_head"
    if kind in ("blocks", "blocks_equal", "bigcode"):
        width = int(fused_envoy.module.weight.shape[0 if hasattr(fused_envoy.module, "in_features") else 1])
        qw = width // 3 if kind == "blocks_equal" else heads * hd
        kw = (width - qw) // 2
        start, stop = [(0, qw), (qw, qw + kw), (qw + kw, width)][i]
        select = _columns(start, stop, hd)
    elif kind == "per_head":
        select = _interleaved(heads, i, hd)
    elif kind == "falcon_mq":
        select = _head_rows([(0, heads), (heads, heads + 1), (heads + 1, heads + 2)][i], heads + 2, hd)
    else:  # pragma: no cover - a table entry with an unknown layout
        raise ValueError(f"unknown fused q/k/v layout {kind!r}")
    return FusedPart(attn, name, fused_envoy, i, select, hd)


def _columns(start, stop, hd):
    def select(t):
        part = t[..., start:stop]
        return part.view(*part.shape[:-1], -1, hd)
    return select


def _interleaved(heads, i, hd):
    def select(t):
        return t.view(*t.shape[:-1], heads, 3, hd)[..., i, :]
    return select


def _head_rows(span, total, hd):
    def select(t):
        return t.view(*t.shape[:-1], total, hd)[..., span[0]:span[1], :]
    return select


def heads_in(heads: int):
    def read(inputs):
        t = first_arg(inputs)
        return t.view(*t.shape[:-1], heads, -1)
    return read


def heads_in_write(new, inputs):
    old = first_arg(inputs)
    if not isinstance(new, torch.Tensor):
        raise ReplacementError(f"replacement must be a tensor, got {type(new).__name__}")
    return with_first_arg(new.reshape(old.shape), inputs)


def _mlp_point(mlp, name):
    refusal = mlp_refusal(mlp)
    if refusal is not None:
        return _unavailable(mlp, name, refusal)
    subs = submodules(mlp.module)
    if "experts" in subs:
        return _unavailable(mlp, name, "this layer's MLP is a sparse mixture of experts: there is no single "
                            "activation. Use mlp.router / mlp.per_expert / mlp.routed (docs/moe.md)")
    act = _find(mlp, *_ACT_NAMES)
    out = _find(mlp, *_MLP_OUT)
    if act is None or out is None:
        return _unavailable(mlp, name, f"no activation module ({', '.join(_ACT_NAMES)}) or down projection found "
                            f"in {type(mlp.module).__name__}; use the MLP's submodules' .input / .output")
    if name == "pre":
        return SemanticPoint(mlp, name, act.inputs, first_arg, with_first_arg)
    return SemanticPoint(mlp, name, out.inputs, first_arg, with_first_arg)


def _head_dim(module):
    hd = getattr(module, "head_dim", None) or getattr(module, "head_size", None)
    if hd is None:
        cfg = getattr(module, "config", None)
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return int(hd)


def _same_memory(flat, view) -> bool:
    """Whether ``flat`` (``view.flatten(-2)``) is a view of ``view``'s memory rather than a copy."""
    return flat.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()


class FusedPart(Point):
    """q, k or v of a fused projection (GPT-2's ``c_attn``, GPT-NeoX's ``query_key_value``...), a point of its own.

    The three parts of one output are three points (each awaited once per
    call, in the order q, k, v), fired from one forward hook on the fused
    module that the first awaited part installs. ``select(t)`` is the part's
    ``[b, n, heads, d_head]`` view of the fused output (its layout is stated
    in :mod:`.archs`), fired flat (``[b, n, heads * d_head]``, so that padded
    layouts cut its sequence) and shown per head: each invoke sees its rows
    of the live value, in-place edits reach the model, a replacement is
    written back into its columns.
    """

    __slots__ = ("owner", "label", "fused", "index", "select", "position")
    kind_label = "semantic points"

    def __init__(self, owner, name, fused, index, select, head_dim):
        self.key, self.gradient, self.order_cache = self, None, None
        self.read = lambda t: t.unflatten(-1, (-1, head_dim))
        self.write = lambda new, old: new.reshape(old.shape) if isinstance(new, torch.Tensor) else new
        self.owner = owner
        self.label = f"{owner.path}.{name}"
        self.fused = fused
        self.index = index
        self.select = select
        self.position = (fused.module, "output")

    def describe(self) -> str:
        return self.label

    def activate_in(self, run, task) -> None:
        if self.fused.root is not run.model:
            raise PointUnavailableError(f"{self.label} belongs to another wrapped model")
        parts = run.state(FusedPart, dict)
        module = self.fused.module
        active = parts.get(module)
        if active is None:
            active = parts[module] = []

            def hook(mod, args, output):
                if run.in_adhoc_call:
                    return None
                t = first_of(output)
                changed = None
                for part in active:
                    # fired as [b, n, heads * d_head] so that layouts cut the sequence too (left padding); a flat
                    # copy (an interleaved layout) is written back after the firing, so in-place edits count
                    view = part.select(t)
                    flat = view.flatten(-2)
                    new = run.fire(part, flat)
                    if new is None:
                        if not _same_memory(flat, view):
                            view.copy_(flat.view(view.shape))
                        continue
                    if changed is None:
                        changed = t.clone()
                    part.select(changed).copy_(new.view(view.shape))
                    t = changed
                return None if changed is None else with_first(changed, output)
            run.on_cleanup(add_forward_hook(module, hook))
            run.keep_ancestors(self.fused)
        if self not in active:
            active.append(self)
            active.sort(key=lambda p: p.index)


# ----------------------------------------------------------------------------- logits


def _logits_point(root):
    if _find(root, "lm_head") is None:
        return None
    return LogitsPoint(root)


class LogitsPoint(Point):
    """``m.logits`` in a trace: the last position of the logits the model *returns* (``[b, vocab]``).

    Read from the model's output, so any final soft-cap or scale the model
    applies after ``lm_head`` (Gemma-2's ``final_logit_softcapping``, Cohere's
    ``logit_scale``, Granite's ``logits_scaling``) is included: these are the
    scores sampling uses. Fired from a forward hook on the model; an in-place
    edit or a replacement changes the returned logits.
    """

    __slots__ = ("root", "label", "position")
    kind_label = "semantic points"

    def __init__(self, root):
        self.key, self.read, self.gradient, self.order_cache = self, None, None, None
        self.write = None
        self.root = root
        self.label = "logits"
        self.position = (root.module, "output")

    def describe(self) -> str:
        return self.label

    def activate_in(self, run, task) -> None:
        if self.root is not run.model:
            raise PointUnavailableError("logits belongs to another wrapped model")
        point = self

        def hook(mod, args, output):
            if run.in_adhoc_call:
                return None
            logits = getattr(output, "logits", None)
            if not isinstance(logits, torch.Tensor):
                raise PointUnavailableError(f"logits: {type(mod).__name__} returned no .logits "
                                            f"({type(output).__name__}); use lm_head.output")
            new = run.fire(point, logits[:, -1])
            if new is None:
                return None
            full = logits.clone()
            full[:, -1] = new
            output.logits = full
            return output
        run.on_cleanup(add_forward_hook(self.root.module, hook))
        run.install_point(self.root.output)     # after this hook: `await m.output` after `await m.logits` works


register_semantic(transformers_point)
