"""LoRA adapters on a vLLM model: adapters registered by name, one chosen per request (vLLM's ``lora_request``).

    model = ai.VLLM(path, lora_modules={"red": "/adapters/red", "blue": "/adapters/blue"})
    model.trace(prompt, fn, adapter="blue")                 # this request runs with adapter "blue"
    with model.generate(max_new_tokens=5) as tr:
        tr.invoke(p, fn, adapter="red")                    # each request its own adapter, in one batch
        tr.invoke(p, fn)                                   # the base model
    model.generate(p, fn, adapter="red")                    # a generation's default for its requests

``adapter=`` matches :class:`~asyncinterp.models.hf.lora.PeftLanguageModel`'s
spelling; here it becomes the request's ``vllm.lora.request.LoRARequest``
(vLLM applies LoRA per token, so requests with different adapters share one
engine step). Adapters are peft directories (``adapter_config.json`` and
weights), as ``vllm serve --lora-modules name=path`` takes them.
``lora_modules`` turns ``enable_lora`` on and, unless given, sets
``max_lora_rank`` to the smallest rank vLLM allows that fits the adapters and
``max_loras`` to their number. Hook points are those of the model: vLLM
wraps the adapted layers (``qkv_proj`` becomes a LoRA layer whose output
includes the adapter's contribution), so ``m.model.layers[0].self_attn.qkv_proj.output``
is what the adapted projection gives.
"""

from __future__ import annotations

import json
import os

__all__ = ["Adapters", "lora_engine_kwargs"]

#: the ranks vLLM 0.32 accepts for ``max_lora_rank``
_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _rank_of(path: str) -> int:
    config = os.path.join(path, "adapter_config.json")
    try:
        with open(config) as f:
            return int(json.load(f).get("r", 8))
    except FileNotFoundError:
        raise ValueError(f"LoRA adapter directory {path!r} has no adapter_config.json: give a directory saved by "
                         "peft (peft_model.save_pretrained(dir))") from None


def lora_engine_kwargs(kw: dict, lora_modules) -> dict:
    """``vllm.LLM``'s keywords for ``lora_modules`` (``{name: directory}``): LoRA on, rank and count that fit."""
    if not lora_modules:
        return kw
    if not isinstance(lora_modules, dict) or not all(isinstance(k, str) and k for k in lora_modules):
        raise TypeError("lora_modules must be a dict {adapter name: adapter directory}, "
                        f"got {type(lora_modules).__name__}")
    kw = dict(kw)
    if kw.get("enable_lora") is False:
        raise ValueError("lora_modules were given with enable_lora=False; drop one of them")
    kw["enable_lora"] = True
    if "max_lora_rank" not in kw:
        need = max(_rank_of(str(p)) for p in lora_modules.values())
        kw["max_lora_rank"] = next((r for r in _RANKS if r >= need), need)
    else:
        for name, path in lora_modules.items():
            if _rank_of(str(path)) > kw["max_lora_rank"]:
                raise ValueError(f"adapter {name!r} has rank {_rank_of(str(path))} > max_lora_rank="
                                 f"{kw['max_lora_rank']}")
    kw.setdefault("max_loras", max(1, len(lora_modules)))
    return kw


class Adapters:
    """The adapters of one vLLM model by name, and the ``LoRARequest`` of a request's ``adapter=``."""

    def __init__(self, lora_modules, enabled: bool):
        self.enabled = enabled
        self.requests = {}
        for name, path in (lora_modules or {}).items():
            self.add(name, str(path))

    @property
    def names(self) -> list:
        return list(self.requests)

    def add(self, name: str, path: str):
        """Register adapter ``name`` (a peft directory); it is loaded by vLLM the first time a request uses it."""
        from vllm.lora.request import LoRARequest
        if not self.enabled:
            raise ValueError("this VLLM model was started without LoRA: pass lora_modules={name: dir} "
                             "(or enable_lora=True) to ai.VLLM")
        if name in self.requests:
            raise ValueError(f"adapter {name!r} is already registered (at {self.requests[name].lora_path})")
        _rank_of(path)
        self.requests[name] = LoRARequest(name, len(self.requests) + 1, path)
        return self.requests[name]

    def request(self, adapter):
        """The ``LoRARequest`` of ``adapter`` (a registered name or a ``LoRARequest``), ``None`` for the base model."""
        if adapter is None:
            return None
        if not self.enabled:
            raise ValueError(f"adapter={adapter!r}: this VLLM model was started without LoRA; pass "
                             "lora_modules={name: adapter_dir} to ai.VLLM")
        if isinstance(adapter, str):
            found = self.requests.get(adapter)
            if found is None:
                raise ValueError(f"no adapter {adapter!r} on this model; registered: {self.names} "
                                 "(add one with ai.VLLM(..., lora_modules={name: dir}) or model.add_adapter)")
            return found
        from vllm.lora.request import LoRARequest
        if isinstance(adapter, LoRARequest):
            return adapter
        raise TypeError(f"adapter must be an adapter name (str) or a vllm LoRARequest, got {type(adapter).__name__}")
