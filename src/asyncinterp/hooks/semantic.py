"""Semantic points: TransformerLens's names for the same values on every engine.

::

    async def fn(m):
        h = await m.layers[3].resid_mid          # residual stream after attention, before the MLP
        q = await m.layers[3].attn.q             # [b, n, heads, d_head], before rotary
        p = await m.layers[3].attn.pattern       # [b, heads, n, n_ctx] attention probabilities
        a = await m.layers[3].mlp.post           # the MLP's activation (input of its down projection)
        return await m.logits                    # [b, vocab] next-token logits

Every semantic point is a derived view of one real module hook point
(``resid_mid`` is ``mlp_norm.input``, ``attn.q`` is ``q_proj.output`` reshaped,
...) built the first time it is looked up: it adds no hook, no attribute and
no per-call work to a model where it is not awaited, and awaiting it costs
what awaiting its real point costs (``resid_post`` *is* the layer's output
hook). Names are looked up only when an envoy has no child or attribute of
that name (real names win), after the standard names of
:mod:`asyncinterp.hooks.aliases`.

Transformers models (GPT-2 and Llama families) are handled here; other
engines (vLLM) give their root envoy a ``build_semantic_point`` method.
"""

from __future__ import annotations

import sys

import torch

from ..kernel.errors import AsyncInterpError, ReplacementError
from .envoy import SEMANTIC_NAMES, HookPoint, register_semantic
from .moe import MOE_NAMES, moe_point
from .modules import add_forward_hook, submodules
from .points import Point
from .views import check_replacement

__all__ = ["NAMES", "SemanticPoint", "PatternPoint", "UnavailablePoint", "PointUnavailableError",
           "transformers_point"]

#: the semantic names, by the kind of envoy they live on
LAYER_NAMES = ("resid_pre", "resid_mid", "resid_post")
ATTN_NAMES = ("q", "k", "v", "pattern")
MLP_NAMES = ("pre", "post")
ROOT_NAMES = ("logits",)
NAMES = frozenset(LAYER_NAMES + ATTN_NAMES + MLP_NAMES + ROOT_NAMES + MOE_NAMES)
assert NAMES == SEMANTIC_NAMES


class PointUnavailableError(AsyncInterpError):
    """A semantic point that this engine (or this architecture) cannot provide; the message says what to use."""


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
        found = resolve(envoy, name)
        if found is not None:
            return found
    return None


_ACT_NAMES = ("act_fn", "act", "activation_fn", "activation", "act_func")


def transformers_point(envoy, name: str):
    """The semantic point ``name`` of ``envoy`` on a transformers model (GPT-2 / Llama families), or ``None``."""
    if name in MOE_NAMES:
        return moe_point(envoy, name)
    if name in LAYER_NAMES:
        attn, mlp, mlp_norm = _find(envoy, "attn"), _find(envoy, "mlp"), _find(envoy, "mlp_norm")
        if attn is None or mlp is None:
            return None
        if name == "resid_pre":
            return SemanticPoint(envoy, name, envoy.inputs, first_arg, with_first_arg)
        if name == "resid_post":
            return SemanticPoint(envoy, name, envoy.output, first_of, with_first)
        if mlp_norm is None:
            return UnavailablePoint(f"{envoy.path}.resid_mid", "this layer has no norm between attention and "
                                    "MLP (no post_attention_layernorm / ln_2); use .attn.output and .mlp.input")
        label = f"{envoy.path}.resid_mid"
        return SemanticPoint(envoy, name, mlp_norm.inputs, first_arg, copy_into_first_arg(label))
    if name in ("q", "k", "v"):
        return _qkv_point(envoy, name)
    if name == "pattern":
        if _find(envoy, "q_proj", "c_attn") is None:
            return None
        return PatternPoint(envoy)
    if name in MLP_NAMES:
        act = _find(envoy, *_ACT_NAMES)
        if act is None or not submodules(envoy.module):
            return None
        if name == "pre":
            return SemanticPoint(envoy, name, act.inputs, first_arg, with_first_arg)
        if "gate_proj" in submodules(envoy.module):      # gated: post = act(gate) * up, the input of down_proj
            down = _find(envoy, "down_proj")
            return SemanticPoint(envoy, name, down.inputs, first_arg, with_first_arg)
        return SemanticPoint(envoy, name, act.output, first_of, with_first)
    if name == "logits" and envoy.parent is None:
        head = _find(envoy, "lm_head")
        if head is None:
            return None
        return SemanticPoint(envoy, name, head.output, last_position, with_last_position)
    return None


def _head_dim(module):
    hd = getattr(module, "head_dim", None)
    if hd is None:
        cfg = getattr(module, "config", None)
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return int(hd)


def _qkv_point(envoy, name):
    subs = submodules(envoy.module)
    proj = f"{name}_proj"
    if proj in subs:                                       # Llama family: separate projections
        return SemanticPoint(envoy, name, envoy.child(proj).output, heads_view(_head_dim(envoy.module)), heads_write)
    if "c_attn" in subs and not getattr(envoy.module, "is_cross_attention", False):   # GPT-2: fused [q | k | v]
        width = int(envoy.module.split_size)
        i = "qkv".index(name)
        return FusedPart(envoy, name, envoy.child("c_attn"), i * width, (i + 1) * width, _head_dim(envoy.module))
    return None


class FusedPart(Point):
    """q, k or v of a fused projection (GPT-2's ``c_attn`` output ``[q | k | v]``), a point of its own.

    The three parts of one output are three points (each awaited once per
    call, in the order q, k, v), fired from one forward hook on the fused
    module that the first awaited part installs. Each invoke sees its rows of
    the columns as ``[b, n, heads, d_head]`` (a live view: in-place edits
    reach the model); a replacement is written back into those columns.
    """

    __slots__ = ("owner", "label", "fused", "start", "stop", "position")
    kind_label = "semantic points"

    def __init__(self, owner, name, fused, start, stop, head_dim):
        self.key, self.gradient = self, None
        self.read = lambda t: t.view(*t.shape[:-1], -1, head_dim)
        self.write = lambda new, old: new.reshape(old.shape) if isinstance(new, torch.Tensor) else new
        self.owner = owner
        self.label = f"{owner.path}.{name}"
        self.fused = fused
        self.start, self.stop = start, stop
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
                    new = run.fire(part, t[..., part.start:part.stop])
                    if new is not None:
                        if changed is None:
                            changed = t.clone()
                        changed[..., part.start:part.stop] = new
                        t = changed
                return None if changed is None else with_first(changed, output)
            run.on_cleanup(add_forward_hook(module, hook))
            run.keep_ancestors(self.fused)
        if self not in active:
            active.append(self)
            active.sort(key=lambda p: p.start)


# ----------------------------------------------------------------------------- attention pattern


def _read_only_pattern(new, value):
    raise ReplacementError(
        "attn.pattern is read-only: it is recomputed from q, k and the mask for reading, and the model's own "
        "attention kernel never materialises it. Edit attn.q / attn.k (or the attention output) instead")


class PatternPoint(Point):
    """``attn.pattern``: softmax(q k^T * scale + mask), ``[b, heads, n, n_ctx]``, computed when awaited.

    Cost when awaited: three extra hooks on the attention block (its inputs,
    its query and key projections), one ``[b, heads, n, n_ctx]`` matmul and
    softmax per call (the model's own fused attention is untouched). It fires
    after the attention block's output. Read-only.
    """

    __slots__ = ("envoy", "label", "position")
    kind_label = "semantic points"

    def __init__(self, envoy):
        self.envoy = envoy
        self.key, self.read, self.gradient = self, None, None
        self.write = _read_only_pattern
        self.label = f"{envoy.path}.pattern"
        self.position = (envoy.module, "output")

    def describe(self) -> str:
        return self.label

    def activate_in(self, run, task) -> None:
        if self.envoy.root is not run.model:
            raise PointUnavailableError(f"{self.label} belongs to another wrapped model")
        done = run.state(PatternPoint, set)
        if self in done:
            return
        done.add(self)
        env = self.envoy
        seen = {}

        def capture(mod, args, kwargs, output):          # first of the block's forward hooks
            if not run.in_adhoc_call:
                seen["inputs"] = (args, kwargs)
        run.on_cleanup(env.module.register_forward_hook(capture, with_kwargs=True, prepend=True))
        subs = submodules(env.module)
        if "q_proj" in subs:
            run.tap(env.child("q_proj").output, lambda v: seen.__setitem__("q", first_of(v)))
            run.tap(env.child("k_proj").output, lambda v: seen.__setitem__("k", first_of(v)))
        else:
            run.tap(env.child("c_attn").output, lambda v: seen.__setitem__("qkv", first_of(v)))

        def at_output(_):
            if "inputs" not in seen:
                return
            value = self.compute(run, seen)
            seen.clear()
            run.fire(self, value)
        run.tap(env.output, at_output)

    def compute(self, run, seen):
        module = self.envoy.module
        subs = submodules(module)
        hd = _head_dim(module)
        args, kwargs = seen["inputs"]
        hidden = args[0] if args else kwargs.get("hidden_states")
        if "q_proj" in subs:
            # activated in the middle of the block's call: project again what was missed (no point fires)
            q = seen["q"] if "q" in seen else run.call_adhoc(subs["q_proj"], (hidden,), {})
            k = seen["k"] if "k" in seen else run.call_adhoc(subs["k_proj"], (hidden,), {})
        else:
            qkv = seen["qkv"] if "qkv" in seen else run.call_adhoc(subs["c_attn"], (hidden,), {})
            width = int(module.split_size)
            q, k = qkv[..., :width], qkv[..., width:2 * width]
        dtype = q.dtype
        q = q.reshape(*q.shape[:-1], -1, hd).transpose(1, 2)       # [b, h, n, d]
        k = k.reshape(*k.shape[:-1], -1, hd).transpose(1, 2)       # [b, kv, n, d]
        pos = kwargs.get("position_embeddings")
        if pos is None and len(args) > 1 and isinstance(args[1], tuple):
            pos = args[1]
        if pos is not None:
            rope = getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb", None)
            if rope is None:
                raise PointUnavailableError(f"{self.label}: no apply_rotary_pos_emb next to {type(module).__name__}")
            q, k = rope(q, k, *pos)
        cache = kwargs.get("past_key_values")
        if cache is None and len(args) > 1 and not isinstance(args[1], (tuple, torch.Tensor)):
            cache = args[1]
        layer_idx = getattr(module, "layer_idx", None)
        if cache is not None and layer_idx is not None:
            try:
                keys = cache.layers[layer_idx].keys
            except (AttributeError, IndexError, TypeError):
                keys = None
            if isinstance(keys, torch.Tensor) and keys.dim() == 4 and keys.shape[1] != k.shape[1]:
                gather = getattr(run, "gather_heads", None)         # tensor parallel: the cache holds this rank's heads
                keys = gather(keys) if gather is not None else None
            if isinstance(keys, torch.Tensor) and keys.dim() == 4 and keys.shape[-2] >= k.shape[-2]:
                k = keys                                            # past + new keys, as attention used them
        q, k = q.float(), k.float()
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        scores = q @ k.transpose(-1, -2) * self._scale(module, hd)
        n, n_ctx = scores.shape[-2], scores.shape[-1]
        mask = kwargs.get("attention_mask")
        if mask is None and len(args) > 2 and isinstance(args[2], torch.Tensor):
            mask = args[2]
        if isinstance(mask, torch.Tensor) and mask.dim() == 4:
            mask = mask[..., -n:, -n_ctx:]
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask, float("-inf"))
            else:
                scores = scores + mask.float()
        else:                                                      # no mask given: causal
            causal = torch.ones(n, n_ctx, dtype=torch.bool, device=scores.device).tril(n_ctx - n)
            scores = scores.masked_fill(~causal, float("-inf"))
        return scores.softmax(-1).to(dtype)

    @staticmethod
    def _scale(module, hd):
        scale = getattr(module, "scaling", None)
        if scale is not None:
            return float(scale)
        scale = 1.0
        if getattr(module, "scale_attn_weights", True):
            scale /= hd ** 0.5
        if getattr(module, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(module.layer_idx + 1)
        return scale


register_semantic(transformers_point)
