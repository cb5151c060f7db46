"""Mixture-of-experts points on vLLM models: ``router``, ``per_expert`` and ``routed`` of a FusedMoE block.

The names and shapes are those of :mod:`asyncinterp.hooks.moe` (transformers),
so one intervention runs on both engines (``m.layers[i].mlp`` is vLLM's
``block_sparse_moe`` through the standard name ``mlp``)::

    logits = await m.layers[0].mlp.router        # [1, n, E]: vLLM's gate output, before top-k
    logits[..., 3] = float("-inf")               # mask expert 3 for this request

What vLLM computes, and so what each point is:

* ``router``: the output of the block's ``gate`` linear. vLLM's fused MoE
  layer takes these logits as its input and does softmax, top-k and the
  experts in one kernel, so an edit here (in place or replaced) is what the
  experts route by: a mask takes effect.
* ``routed``: the output of the fused experts (``experts``, the weighted sum
  of the chosen experts' outputs; with tensor parallelism vLLM reduces it
  across ranks inside the layer). Readable and writable.
* Blocks with a shared expert (Qwen2-MoE): vLLM adds it inside the fused experts' call, so
  ``routed`` and ``per_expert`` are refused there (``PointUnavailableError``); ``router`` works.
* ``per_expert``: ``[1, n, E, hidden]``, each expert's output for each token
  before the routing weight. The fused kernel never materialises it, so it is
  computed when awaited by vLLM's own fused experts, called once per expert
  on the block's input with router logits that send every token to that
  expert alone (E extra expert calls; the CPU kernel repacks the experts'
  weights, so they are not read directly). Read-only.

Under tensor parallelism (tested at 2 on CPU) every rank runs the same
intervention: the gate is replicated, and the fused experts all-reduce their
partial sums inside the layer, so all three points are full values on every
rank. Expert parallelism is not tested.
"""

from __future__ import annotations

import torch

from ...hooks import semantic as sem
from ...hooks.moe import MOE_NAMES
from ...hooks.modules import submodules
from ...kernel.errors import ReplacementError

__all__ = ["vllm_moe_point", "is_moe_block"]


def _each_expert(label, experts, num_experts: int):
    """Read/write of ``per_expert``: the fused experts run once per expert, with all routing on that expert."""

    def read(inputs):
        args, kwargs = inputs
        x = args[0] if args else kwargs["hidden_states"]
        flat = x.reshape(-1, x.shape[-1])
        outs = []
        for e in range(num_experts):
            # softmax of [-inf, .., 0, .., -inf] is one-hot: top-k takes expert e with weight 1 (the others 0)
            logits = torch.full((flat.shape[0], num_experts), float("-inf"), dtype=torch.float32, device=x.device)
            logits[:, e] = 0.0
            out = experts.forward(flat, logits.to(x.dtype))      # forward, not __call__: no hook fires
            outs.append(out[0] if isinstance(out, tuple) else out)
        return torch.stack(outs, dim=-2).reshape(*x.shape[:-1], num_experts, -1)

    def write(new, inputs):
        raise ReplacementError(f"{label} is read-only: it is computed when awaited, by running the fused experts "
                               "once per expert (vLLM's kernel never materialises it). Edit .router or .routed")
    return read, write


def is_moe_block(module) -> bool:
    """A vLLM MoE block: a ``gate`` linear and fused ``experts`` (``FusedMoE`` / ``MoERunner``)."""
    subs = submodules(module)
    gate, experts = subs.get("gate"), subs.get("experts")
    if gate is None or experts is None or getattr(gate, "weight", None) is None:
        return False
    return any(k in type(experts).__name__ for k in ("FusedMoE", "MoERunner"))


def vllm_moe_point(envoy, name: str):
    """``router``, ``per_expert`` or ``routed`` of a vLLM MoE block, or ``None`` (not such a block)."""
    if name not in MOE_NAMES or not is_moe_block(envoy.module):
        return None
    label = f"{envoy.path}.{name}"
    if name == "router":
        return sem.SemanticPoint(envoy, name, envoy.child("gate").output, sem.first_of, sem.with_first)
    shared = sorted(n for n in submodules(envoy.module) if n.startswith("shared_expert"))
    if shared:
        return sem.UnavailablePoint(label, (
            f"on {type(envoy.root.module).__name__}, this block ({type(envoy.module).__name__}) has a shared expert "
            f"({shared[0]}), which vLLM's fused "
            "experts call inside the same call and add to their output: neither that output nor a per-expert call "
            "is the routed experts alone (transformers' value). Read mlp.router here, or the block's output "
            "(mlp.output: routed + shared)"))
    experts = envoy.child("experts")
    if name == "routed":
        return sem.SemanticPoint(envoy, name, experts.output, sem.first_of, sem.with_first)
    config = getattr(experts.module, "moe_config", None)
    n = getattr(config, "num_experts", None) or getattr(envoy.child("gate").module, "output_size", None)
    if not n:
        return sem.UnavailablePoint(label, "the number of experts of this block is not known (no moe_config)")
    read, write = _each_expert(label, experts.module, int(n))
    return sem.SemanticPoint(envoy, name, experts.inputs, read, write)
