"""Mixture-of-experts points on transformers models: the router's logits, each expert's output, the routed sum.

::

    async def fn(m):
        moe = m.model.layers[0].mlp                 # the sparse MoE block (Mixtral, Qwen2-MoE, OLMoE...)
        logits = await moe.router                   # [b, n, num_experts] router logits, before top-k
        logits[..., 3] = float("-inf")              # mask expert 3: top-k, weights and output follow
        each = await moe.per_expert                 # [b, n, num_experts, hidden]: every expert on every token
        out = await moe.routed                      # [b, n, hidden]: the weighted sum of the chosen experts

Why a point of its own: transformers 5 computes the routing in one call of
the router module (``gate``), which returns ``(logits, top-k weights, top-k
indices)`` for the *flattened* batch ``[b * n, ...]``. Editing the logits
element of that output changes nothing (the weights and indices are already
computed: nnsight's docs warn that masking ``gate.output[0]`` is a silent
no-op), and a flat ``[b * n]`` value cannot be split into invokes. Here:

* ``router``: the logits as ``[b, n, E]`` (each invoke its rows). After the
  intervention, if the logits changed (in place or replaced), the top-k
  weights and indices are computed again from them exactly as the router
  does (softmax in float32, top-k, renormalised when the router does), so a
  mask or an edit takes effect. Before that, the rule is checked against
  what the router itself returned for the unedited logits: a router with
  another rule (sigmoid, top-k before softmax...) makes the edit a
  :class:`MoEPointError`, never a silent no-op or a wrong routing.
* ``gate.output`` on such a block is the same firing shown as the router's
  own tuple ``(logits [b, n, E], weights [b, n, k], indices [b, n, k])``;
  an edit of ``[0]`` (in place, or a replaced tuple) is routed again like
  ``router``; weights or indices that differ from the router's are kept as
  given for those tokens. Edits are found by value, token by token, never
  by object identity: a replaced tuple holds the user's views.
* ``per_expert``: ``[b, n, E, hidden]``, what each expert outputs for every
  token, before the routing weight (computed when awaited from the experts'
  input and weights: the fused experts module never materialises it for
  experts a token was not routed to). Read-only: edit ``router`` or ``routed``.
* ``routed``: ``[b, n, hidden]``, the experts module's output (the routed
  experts' weighted sum; Qwen2-MoE's shared expert is added after it).
  Readable and writable.

``per_expert`` fires before ``routed`` (both after the experts ran). A model
without such a block has none of these names. vLLM's names are in
:mod:`asyncinterp.models.vllm.moe`.
"""

from __future__ import annotations

import torch

from ..kernel.errors import AsyncInterpError, ReplacementError
from .aliases import register as register_alias
from .envoy import Envoy, point, register_envoy_class
from .modules import add_forward_hook, add_forward_pre_hook, submodules
from .points import Point

__all__ = ["MOE_NAMES", "MoEPoint", "MoEPointError", "moe_point", "route", "check_rule", "is_moe_block"]

MOE_NAMES = ("router", "per_expert", "routed")

# vLLM's Mixtral calls its MoE block ``block_sparse_moe`` (transformers 5: ``mlp``): one intervention for both
register_alias("mlp", "block_sparse_moe")


class MoEPointError(AsyncInterpError):
    """An MoE point that this block cannot provide, or an edit it cannot honour (the message says why)."""


def is_moe_block(module) -> bool:
    """A transformers sparse MoE block: a ``gate`` router with ``top_k`` and 2-D ``weight``, and ``experts``."""
    subs = submodules(module)
    gate, experts = subs.get("gate"), subs.get("experts")
    if gate is None or experts is None:
        return False
    w = getattr(gate, "weight", None)
    return isinstance(getattr(gate, "top_k", None), int) and isinstance(w, torch.Tensor) and w.dim() == 2


def route(router, logits, like_weights):
    """The top-k weights and indices ``router`` computes from ``logits`` (``[T, E]``), as transformers does."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, indices = torch.topk(probs, router.top_k, dim=-1)
    if getattr(router, "norm_topk_prob", True):          # Mixtral always renormalises
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(like_weights.dtype), indices


def check_rule(path, router, logits, weights, indices) -> None:
    """Raise unless :func:`route` gives what ``router`` gave for ``logits`` (so re-routing an edit is faithful)."""
    w, i = route(router, logits, weights)
    order_a, order_b = indices.sort(-1), i.sort(-1)
    same = torch.equal(order_a.values, order_b.values) and torch.allclose(
        weights.gather(-1, order_a.indices), w.gather(-1, order_b.indices), atol=1e-6, rtol=1e-5)
    if not same:
        raise MoEPointError(
            f"{path}: the router logits were edited, but {type(router).__name__} does not route by softmax -> "
            "top-k (-> renormalise), the rule asyncinterp re-routes with, so the edit cannot be applied "
            "faithfully. Edit .routed, or replace the whole gate.output tuple (logits, weights, indices)")


def _read_only(label):
    def write(new, value):
        raise ReplacementError(f"{label} is read-only: it is computed from the experts' weights when awaited "
                               "(the fused experts never materialise it). Edit .router (routing) or .routed "
                               "(the experts' weighted sum) instead")
    return write


def _each_expert(experts, x):
    """``[T, E, hidden]``: every expert of a transformers fused experts module applied to ``x`` (``[T, hidden]``)."""
    if (getattr(experts, "is_transposed", False) or getattr(experts, "has_bias", False)
            or not getattr(experts, "has_gate", True) or not getattr(experts, "is_concatenated", True)
            or not hasattr(experts, "gate_up_proj") or not hasattr(experts, "down_proj")):
        raise MoEPointError(f"per_expert: {type(experts).__name__} stores its experts in a layout this point does "
                            "not read (it reads gate_up_proj [E, 2I, H] and down_proj [E, H, I], no bias); "
                            "use .routed")
    gate_up = torch.einsum("th,eoh->teo", x, experts.gate_up_proj)
    apply = getattr(experts, "_apply_gate", None)
    if apply is not None:
        act = apply(gate_up)
    else:
        g, u = gate_up.chunk(2, dim=-1)
        act = experts.act_fn(g) * u
    return torch.einsum("tei,ehi->teh", act, experts.down_proj)


class MoEPoint(Point):
    """``router``, ``gate_output``, ``per_expert`` or ``routed`` of one transformers MoE block (see module doc)."""

    __slots__ = ("block", "kind", "label", "position")
    kind_label = "MoE points"

    def __init__(self, block, kind: str, label: str | None = None):
        self.key, self.read, self.gradient, self.order_cache = self, None, None, None
        self.block = block
        self.kind = kind
        self.label = label or f"{block.path}.{kind}"
        self.write = None
        if kind == "per_expert":   # fired as [b, n, E * hidden] (layouts cut 3-D values along the sequence)
            self.write = _read_only(self.label)
            experts = submodules(block.module)["experts"]
            self.read = lambda v, e=int(experts.num_experts): v.unflatten(-1, (e, -1))
        sub = "gate" if kind in ("router", "gate_output") else "experts"
        self.position = (submodules(block.module)[sub], "output")

    def describe(self) -> str:
        return self.label

    def __repr__(self):
        return f"<MoE point {self.label}>"

    def activate_in(self, run, task) -> None:
        if self.block.root is not run.model:
            raise MoEPointError(f"{self.label} belongs to another wrapped model")
        blocks = run.state(MoEPoint, dict)
        module = self.block.module
        active = blocks.get(module)
        if active is None:
            active = blocks[module] = {}
            _install(run, self.block, active)
        active[self.kind] = self


def _install(run, block, active):
    """The hooks of one MoE block in one run: its input shape, the router's output, the experts' output."""
    module = block.module
    subs = submodules(module)
    gate, experts = subs["gate"], subs["experts"]
    shape = {}

    def on_block(mod, args, kwargs):
        if not run.in_adhoc_call:
            h = args[0] if args else next(iter(kwargs.values()))
            shape["bn"] = tuple(h.shape[:-1])

    def rows(t):
        bn = shape.get("bn")
        if bn is None or len(bn) != 2 or bn[0] * bn[1] != t.shape[0]:
            raise MoEPointError(f"{block.path}: the MoE block's input was not [batch, seq, hidden] as expected "
                                f"(saw {bn}); its points need that shape")
        return t.view(*bn, *t.shape[1:])

    def on_gate(mod, args, output):
        if run.in_adhoc_call or not ("router" in active or "gate_output" in active):
            return None
        logits, weights, indices = output
        # copies of what the router gave: edits (in place or by replacement) are found by value, per token,
        # never by object identity (a replaced tuple holds the user's views, never the router's own objects)
        before, w_before, i_before = logits.clone(), weights.clone(), indices.clone()
        new_logits, new_w, new_i = logits, weights, indices
        if "router" in active:
            new = run.fire(active["router"], rows(logits))
            if new is not None:
                new_logits = new.reshape(logits.shape)
        if "gate_output" in active:
            view = (rows(new_logits), rows(weights), rows(indices))
            new = run.fire(active["gate_output"], view)
            if new is not None:
                new_logits, new_w, new_i = (t.reshape(o.shape) for t, o in zip(new, output))
        return _settle(block.path, mod, (logits, weights, indices), (before, w_before, i_before),
                       (new_logits, new_w, new_i))

    def on_experts(mod, args, output):
        if run.in_adhoc_call:
            return None
        if "per_expert" in active:
            x = args[0] if args else None
            run.fire(active["per_expert"], rows(_each_expert(mod, x).flatten(1)))
        if "routed" in active:
            new = run.fire(active["routed"], rows(output))
            if new is not None:
                return new.reshape(output.shape)
        return None

    run.on_cleanup(add_forward_pre_hook(module, on_block, with_kwargs=True))
    run.on_cleanup(add_forward_hook(gate, on_gate))
    run.on_cleanup(add_forward_hook(experts, on_experts))
    run.keep_ancestors(block.child("gate"))
    run.keep_ancestors(block.child("experts"))


def _differs(new, old):
    """Per token row: whether ``new`` differs from ``old`` in any element (NaN equals NaN)."""
    same = new == old
    if new.is_floating_point():
        same |= new.isnan() & old.isnan()
    return ~same.all(-1)


def _settle(path, router, output, original, edited):
    """The gate's output after the interventions: ``None`` (unchanged or edited in place) or a new tuple.

    Per token row: where the top-k weights or indices differ from what the
    router gave, they are kept as given; elsewhere, if the logits differ,
    the weights and indices are routed again from the edited logits (after
    checking that the router's rule is the one re-routing uses). So a
    replaced tuple ``(masked_logits, weights, indices)`` re-routes exactly
    like an in-place mask, and an explicit routing is honoured as given.
    """
    logits, weights, indices = output
    before, w_before, i_before = original
    new_logits, new_w, new_i = edited
    if _differs(new_logits, before).any():
        given = _differs(new_w, w_before) | _differs(new_i, i_before)
        check_rule(path, router, before, w_before, i_before)   # the rule must reproduce the router's own
        routed_w, routed_i = route(router, new_logits, w_before)
        keep = given.unsqueeze(-1)
        new_w = torch.where(keep, new_w, routed_w)
        new_i = torch.where(keep, new_i, routed_i)
    if new_logits is logits and new_w is weights and new_i is indices:
        return None
    return new_logits, new_w, new_i


def moe_point(envoy, name: str):
    """The MoE point ``name`` of ``envoy`` (a transformers sparse MoE block), or ``None``."""
    if name in MOE_NAMES and is_moe_block(envoy.module):
        return MoEPoint(envoy, name)
    return None


# ----------------------------------------------------------------------------- the router's own output


def is_router(module) -> bool:
    """A transformers top-k router (``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``, ``OlmoeTopKRouter``...)."""
    return type(module).__name__.endswith("TopKRouter") and isinstance(getattr(module, "top_k", None), int)


class _gate_output(point):
    """``gate.output`` of a router inside an MoE block: the ``gate_output`` :class:`MoEPoint` (edits re-route)."""

    def __get__(self, envoy, owner=None):
        if envoy is None:
            return self
        made = envoy.points.get("output")
        if made is None:
            parent = envoy.parent
            if parent is None or not is_moe_block(parent.module) or submodules(parent.module)["gate"] is not envoy.module:
                return point.__get__(self, envoy, owner)          # a router used elsewhere: the plain point
            made = envoy.points["output"] = MoEPoint(parent, "gate_output", f"{envoy.path}.output")
        object.__setattr__(envoy, "output", made)
        return made


class RouterEnvoy(Envoy):
    """The envoy of a transformers MoE router: its ``output`` is the router's tuple per token row, and edits of
    the logits re-route (nnsight's silent no-op of masking ``gate.output[0]`` does not happen here)."""

    output = _gate_output(doc="(logits [b, n, E], top-k weights [b, n, k], top-k indices [b, n, k]); "
                              "an edit of the logits re-routes")


register_envoy_class(is_router, RouterEnvoy)
