"""The parity suite's interventions: one list of reads and edits of the semantic points, for every engine.

Used by ``test_parity.py`` (tiny Llama), ``test_parity_smollm2.py`` (SmolLM2-135M) and
``test_vllm_tp.py`` (tensor parallel 2). Everything here is a module-level function or a
closure over module-level names, so it cloudpickles to vLLM's worker processes under TP.
"""

from __future__ import annotations

import torch

#: every semantic point of a decoder layer, in the order they fire within the layer
VLLM_POINTS = ["resid_pre", "q", "k", "v", "pattern", "resid_mid", "mlp.pre", "mlp.post", "resid_post"]
#: the writable ones (``attn.pattern`` is read-only)
VLLM_EDITS = [p for p in VLLM_POINTS if p != "pattern"]

PROMPT = "Once upon a time in a land far away"


def point_at(m, layer, name):
    """The envoy point ``name`` (``"q"``, ``"mlp.pre"``, ``"resid_mid"``, ...) of decoder layer ``layer``."""
    if name.startswith("mlp."):
        return getattr(m.layers[layer].mlp, name[4:])
    if name in ("q", "k", "v", "pattern"):
        return getattr(m.layers[layer].attn, name)
    return getattr(m.layers[layer], name)


def read_points(layers, points=VLLM_POINTS):
    """An intervention that reads (clones) ``points`` at each of ``layers`` and the logits: ``{"i.name": t}``."""
    layers = list(range(layers)) if isinstance(layers, int) else list(layers)

    async def fn(m):
        out = {}
        for i in layers:
            for name in points:
                out[f"{i}.{name}"] = (await point_at(m, i, name)).clone()
        out["logits"] = (await m.logits).clone()
        return out
    return fn


def edit_point(layer, name, seed, by="inplace", scale=0.5):
    """An intervention that adds ``delta = scale * randn`` (seeded) at one point and returns the logits.

    ``by="inplace"`` edits the awaited tensor, ``"replace"`` assigns ``x + delta``. ``scale`` is a
    number, or a string ``"<f>rms"`` (``"0.5rms"``): ``f`` times the tensor's RMS, so that an edit
    on real weights is neither lost in nor overwhelming the activations.
    """
    async def fn(m):
        point = point_at(m, layer, name)
        x = await point
        delta = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))
        if isinstance(scale, str):
            delta = delta * float(scale[:-3]) * x.float().pow(2).mean().sqrt().item()
        else:
            delta = delta * scale
        delta = delta.to(x.dtype)
        if by == "inplace":
            x += delta
        else:
            point.replace(x + delta)
        return (await m.logits).clone()
    return fn


def read_logits():
    async def fn(m):
        return (await m.logits).clone()
    return fn


def scaled_error(got, want) -> float:
    """max |got - want| / max |want|: the error relative to the tensor's scale."""
    return (got.double() - want.double()).abs().max().item() / max(want.double().abs().max().item(), 1e-30)


def assert_scaled_close(got, want, tol, what=""):
    """``max |got - want| <= tol * max |want|`` (shapes equal)."""
    assert got.shape == want.shape, (what, tuple(got.shape), tuple(want.shape))
    err = scaled_error(got, want)
    assert err <= tol, f"{what}: max |diff| / max |want| = {err:.3g} > {tol:g}"


def read_each_step(layer, points=("q", "pattern", "resid_mid")):
    """An intervention that reads ``points`` of ``layer`` and the logits at every generation step: a list of dicts."""
    async def fn(m):
        out = []
        async for _ in m.steps():
            step = {name: (await point_at(m, layer, name)).clone() for name in points}
            step["logits"] = (await m.logits).clone()
            out.append(step)
        return out
    return fn
