"""TransformerLens's names on vLLM's module trees, per architecture: which real hook point each semantic point is.

Why this module exists: vLLM implements every architecture in its own file, with other
module names and another way of passing the residual stream between layers
(:mod:`.archs` states those facts once per model class). Here each semantic name of
:mod:`asyncinterp.hooks.semantic` is mapped to a real hook point of vLLM's tree, from
those facts and from what the model's own modules receive (the merged ``QKVParallelLinear``
output, the attention op's inputs, the activation's input, the down projection's input):

* ``resid_pre`` / ``resid_post``: the layer's stream input / output; a ``(x, residual)``
  pair whose sum is the stream is folded into ``x`` (live view, see :mod:`.points`); a pair
  whose first element already is the stream shows that element;
* ``resid_mid``: the first input of the architecture's pre-MLP norm (folded when it takes
  a residual), or the MLP's input, or a ``PointUnavailableError`` where attention and MLP
  run in parallel;
* ``attn.q/k/v``: columns of the block's ``QKVParallelLinear`` output; ``attn.pattern``:
  computed from the attention op's inputs (:class:`.points.PatternPoint`);
* ``mlp.pre`` / ``mlp.post``: the gate half of ``gate_up_proj``'s output and the input of
  ``down_proj`` (gated MLPs), or the up projection's output (the activation's input) and the down projection's input;
* ``attn.z``: the per-head attention output before the output projection (TransformerLens's
  ``hook_z``), ``[1, n, heads, d_head]``: the input of ``o_proj`` / ``c_proj`` / ``dense`` /
  ``out_proj`` with the heads split out (an attribute of :class:`AttentionEnvoy`);
* MoE blocks: ``router`` / ``per_expert`` / ``routed`` (:mod:`.moe`); their ``mlp.pre/post``
  are per expert and refused.

Whatever cannot be given is an :class:`~asyncinterp.hooks.semantic.UnavailablePoint`
whose await raises ``PointUnavailableError`` naming the architecture, the point and why.
"""

from __future__ import annotations

import inspect

from ...hooks import semantic as sem
from ...hooks.envoy import Envoy
from ...hooks.modules import submodules
from ...hooks.views import check_replacement
from .archs import arch_of, unsupported_reason
from .moe import is_moe_block, vllm_moe_point
from .points import PatternPoint, QKVPart, fold_args, fold_residual, gate_half, stream_writer, unfold_args
from .points import with_gate_half

__all__ = ["vllm_semantic_point", "AttentionEnvoy", "is_attention_block"]

_QKV = ("qkv_proj", "c_attn", "query_key_value")
_UPS = ("c_fc", "fc1", "fc_in", "dense_h_to_4h", "up_proj")
_DOWNS = ("down_proj", "c_proj", "fc2", "fc_out", "dense_4h_to_h")


def _arg_index(module, name="hidden_states") -> int:
    """The positional index of ``name`` in ``module.forward`` (the stream argument of a decoder layer)."""
    try:
        params = [p for p in inspect.signature(module.forward).parameters if p != "self"]
    except (TypeError, ValueError):
        return 0
    for candidate in (name, "x", "hidden_state"):
        if candidate in params:
            return params.index(candidate)
    return 0


def _arg(at: int):
    """Read: the tensor at ``args[at]`` (or the ``hidden_states`` / ``x`` keyword) of an ``(args, kwargs)`` call."""
    def read(inputs):
        args, kwargs = inputs
        if len(args) > at:
            return args[at]
        return kwargs.get("hidden_states", kwargs.get("x"))
    return read


def _copy_into(label: str, at: int):
    """Write: copy the replacement *into* the tensor passed at ``args[at]``.

    The caller keeps that tensor as its residual (``residual = h; h = norm(h)``), so every
    holder continues with the new value, as transformers' ``resid_mid`` does.
    """
    read = _arg(at)

    def write(new, inputs):
        old = read(inputs)
        check_replacement(label, new, old)
        old.copy_(new)
        return inputs
    return write


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _arch_label(model) -> str:
    hf = getattr(getattr(model, "config", None), "architectures", None)
    name = type(model).__name__
    return f"{name} ({hf[0]})" if hf and hf[0] != name else name


def _layer_point(root, envoy, name, arch, model):
    label = f"{envoy.path}.{name}"
    pair = arch.stream == "sum"
    if name == "resid_pre":
        at = _arg_index(envoy.module)
        if pair:
            return sem.SemanticPoint(envoy, name, envoy.inputs, lambda v: fold_args(v, at), unfold_args(label, at))
        return sem.SemanticPoint(envoy, name, envoy.inputs, _arg(at), _copy_into(label, at))
    if name == "resid_post":
        return sem.SemanticPoint(envoy, name, envoy.output, fold_residual if pair else _first,
                                 stream_writer(label, False))
    mid, why = arch.mid_of(getattr(model, "config", None))
    if mid is None:
        return sem.UnavailablePoint(label, f"on {_arch_label(model)}, {why}")
    if mid not in submodules(envoy.module):
        return sem.UnavailablePoint(label, f"on {_arch_label(model)}, this layer has no {mid!r} module")
    child = envoy.child(mid)
    if pair and mid != "mlp":
        return sem.SemanticPoint(envoy, name, child.inputs, fold_args, unfold_args(label, 0))
    return sem.SemanticPoint(envoy, name, child.inputs, _arg(0), _copy_into(label, 0))


def _attn_point(envoy, name, model):
    subs = submodules(envoy.module)
    label = f"{envoy.path}.{name}"
    proj = next((n for n in _QKV if n in subs), None)
    # a LoRA-enabled engine wraps the projection (its output then has the adapter's delta: what the model uses)
    module = None if proj is None else getattr(subs[proj], "base_layer", subs[proj])
    if module is None or type(module).__name__ != "QKVParallelLinear":
        return sem.UnavailablePoint(label, f"on {_arch_label(model)}, this attention block has no merged "
                                    "QKVParallelLinear projection to take q, k and v from")
    if getattr(module, "skip_bias_add", False) and getattr(module, "bias", None) is not None:
        return sem.UnavailablePoint(label, f"on {_arch_label(model)}, the q/k/v projection returns its bias "
                                    "separately (the block adds it later), so its output is not q, k and v")
    if name in ("q", "k", "v"):
        return QKVPart(envoy, name, envoy.child(proj))
    if "attn" not in subs:
        return sem.UnavailablePoint(label, f"on {_arch_label(model)}, this attention block has no inner `attn` op")
    return PatternPoint(envoy, envoy.child("attn"))


def _mlp_point(envoy, name, model):
    subs = submodules(envoy.module)
    label = f"{envoy.path}.{name}"
    if "gate_up_proj" in subs and "down_proj" in subs:
        if name == "pre":
            return sem.SemanticPoint(envoy, name, envoy.child("gate_up_proj").output, gate_half, with_gate_half)
        return sem.SemanticPoint(envoy, name, envoy.child("down_proj").inputs, sem.first_arg, sem.with_first_arg)
    up = next((n for n in _UPS if n in subs), None)
    down = next((n for n in _DOWNS if n in subs), None)
    if up is None or down is None:
        return sem.UnavailablePoint(label, f"on {_arch_label(model)}, this MLP ({type(envoy.module).__name__}) "
                                    "has no up and down projection to read it from")
    if getattr(subs[up], "skip_bias_add", False) and getattr(subs[up], "bias", None) is not None:
        return sem.UnavailablePoint(label, f"on {_arch_label(model)}, the MLP's up projection returns its bias "
                                    "separately, so its output is not the activation's input")
    if name == "pre":       # the activation's input: the up projection's output (vLLM shares one activation
        # module between layers on some architectures, so its own hook would fire once per layer)
        return sem.SemanticPoint(envoy, name, envoy.child(up).output, sem.first_of, sem.with_first)
    return sem.SemanticPoint(envoy, name, envoy.child(down).inputs, sem.first_arg, sem.with_first_arg)


_ATTN_NAMES = ("self_attn", "attn", "attention", "self_attention")


def _is_attention(root, envoy) -> bool:
    """The attention block of a decoder layer (by its name in the layer, or by what it holds)."""
    subs = submodules(envoy.module)
    if "attn" in subs or any(n in subs for n in _QKV):
        return True
    parent = getattr(envoy, "parent", None)
    return (parent is not None and id(parent.module) in root.layer_ids
            and envoy.path.rsplit(".", 1)[-1] in _ATTN_NAMES)


def vllm_semantic_point(root, envoy, name):
    """The semantic point ``name`` of ``envoy`` on a vLLM model (see asyncinterp.hooks.semantic), or ``None``."""
    model = root.module
    arch = arch_of(model)
    label = f"{envoy.path}.{name}"
    if name in sem.MOE_NAMES:
        if arch is None and is_moe_block(envoy.module):
            return sem.UnavailablePoint(label, unsupported_reason(model))
        return vllm_moe_point(envoy, name)
    if name in sem.LAYER_NAMES:
        if id(envoy.module) not in root.layer_ids:
            return None
        if arch is None:
            return sem.UnavailablePoint(label, unsupported_reason(model))
        return _layer_point(root, envoy, name, arch, model)
    if name in ("q", "k", "v", "pattern") and _is_attention(root, envoy):
        if arch is None:
            return sem.UnavailablePoint(label, unsupported_reason(model))
        return _attn_point(envoy, name, model)
    parent = getattr(envoy, "parent", None)
    if name in sem.MLP_NAMES and parent is not None and id(parent.module) in root.layer_ids:
        if arch is None:
            return sem.UnavailablePoint(label, unsupported_reason(model))
        if is_moe_block(envoy.module):
            return sem.UnavailablePoint(label, f"on {_arch_label(model)}, this is a mixture-of-experts block: its "
                                        "activations are per expert. Read mlp.router, mlp.per_expert or mlp.routed")
        return _mlp_point(envoy, name, model)
    return None


# ----------------------------------------------------------------------------- attn.z

_OUTS = ("o_proj", "c_proj", "dense", "out_proj")


def is_attention_block(module) -> bool:
    """A vLLM attention block: it holds the attention op (``attn``, vLLM's ``Attention``) itself."""
    inner = submodules(module).get("attn")
    return inner is not None and type(inner).__name__ == "Attention"


def _z_point(envoy):
    model = envoy.root.module
    label = f"{envoy.path}.z"
    if arch_of(model) is None:
        return sem.UnavailablePoint(label, unsupported_reason(model))
    subs = submodules(envoy.module)
    out = next((n for n in _OUTS if n in subs), None)
    if out is None:
        return sem.UnavailablePoint(label, f"on {_arch_label(model)}, this attention block has no output "
                                    "projection to read the per-head output from")
    proj = subs[out]
    if getattr(proj, "input_size_per_partition", None) != getattr(proj, "input_size", None):
        return sem.UnavailablePoint(label, "under tensor parallelism each rank holds only its heads of the "
                                    "attention output; attn.z is not gathered yet (read it at TP=1)")
    d = int(subs["attn"].head_size)

    def read(inputs):
        t = sem.first_arg(inputs)
        return t.view(*t.shape[:-1], -1, d)

    def write(new, inputs):
        old = sem.first_arg(inputs)
        want = (*old.shape[:-1], old.shape[-1] // d, d)
        if not hasattr(new, "shape") or tuple(new.shape) != want:
            from ...kernel.errors import ReplacementError
            raise ReplacementError(f"replacement for {label} must be a tensor of shape {want} ([1, tokens of this "
                                   "request in this step, heads, d_head]); edit the awaited tensor in place, or "
                                   "build the replacement from it")
        return sem.with_first_arg(new.reshape(old.shape), inputs)
    return sem.SemanticPoint(envoy, "z", envoy.child(out).inputs, read, write)


class AttentionEnvoy(Envoy):
    """A vLLM attention block: adds ``z``, the per-head attention output before the output projection."""

    @property
    def z(self):
        """``[1, n, heads, d_head]`` per request: the output projection's input with the heads split out."""
        made = self.points.get("z")
        if made is None:
            made = self.points["z"] = _z_point(self)
        return made
