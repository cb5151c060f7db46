"""``GET /v1/capabilities``: which points the served model gives, with their shapes and dtypes, or why not.

A client that writes an intervention for a model it did not load needs to
know which semantic points (``layers[i].resid_mid``, ``attn.pattern``, ...)
this architecture gives and what they hold; the answer comes from the model
itself, not from a table: the first request runs one probe trace of a short
prompt on the served model (whatever its engine: transformers or vLLM; in a
worker thread, beside the batches), in which one sub-task per point awaits it. Each point is listed with
its shape and dtype, the dimension that is the sequence written ``"n"``; each
point the model cannot give is listed with the refusal it raises (which names
the architecture and says why). The answer is computed once and kept.
"""

from __future__ import annotations

import functools

from starlette.responses import JSONResponse
from starlette.routing import Route

from ... import aio
from ...hooks.moe import MOE_NAMES
from ...hooks.semantic import ATTN_NAMES, LAYER_NAMES, MLP_NAMES

__all__ = ["PROBE", "probe_points", "routes"]

#: the probe prompt's token count is read back from the model; its text
PROBE = "The quick brown fox jumps over the lazy dog"
_MODEL_POINTS = ("embed.output", "final_norm.output", "logits")


def routes(server) -> list:
    """The route this module adds to ``server``'s app."""
    return [Route("/v1/capabilities", functools.partial(_capabilities, server), methods=["GET"])]


def _point_names(n_layers: int) -> list:
    names = list(_MODEL_POINTS)
    for i in range(n_layers):
        names += [f"layers.{i}.{n}" for n in LAYER_NAMES]
        names += [f"layers.{i}.attn.{n}" for n in ATTN_NAMES]
        names += [f"layers.{i}.mlp.{n}" for n in MLP_NAMES]
        names += [f"layers.{i}.mlp.{n}" for n in MOE_NAMES]
    return names


def _describe(value, n_tokens: int) -> dict:
    import torch
    if isinstance(value, tuple) and value and isinstance(value[0], torch.Tensor):
        value = value[0]
    if not isinstance(value, torch.Tensor):
        return {"type": type(value).__name__}
    shape = ["n" if d == n_tokens else int(d) for d in value.shape]
    return {"shape": shape, "dtype": str(value.dtype).replace("torch.", "")}


def probe_points(n_layers: int, n_tokens: int):
    """An intervention that awaits every point (one sub-task each) and returns ``(points, refused)``."""
    async def probe(m):
        from ... import spawn

        async def one(name):
            try:
                return name, True, _describe(await m.at(name), n_tokens)
            except Exception as exc:  # noqa: BLE001 - a refusal is the answer for this point
                return name, False, f"{type(exc).__name__}: {exc}"

        tasks = [await spawn(one(name)) for name in _point_names(n_layers)]
        outcomes = [await task for task in tasks]
        points = {name: info for name, ok, info in outcomes if ok}
        moe = any(name.rsplit(".", 1)[-1] in MOE_NAMES for name in points)
        # a model without mixture-of-experts blocks: its layers simply have no MoE points (not refusals)
        refused = {name: info for name, ok, info in outcomes
                   if not ok and (moe or name.rsplit(".", 1)[-1] not in MOE_NAMES)}
        return points, refused
    probe.__qualname__ = probe.__name__ = "capabilities-probe"
    return probe


async def _capabilities(server, request):
    async def work(fields):
        cached = getattr(server, "capabilities", None)
        if cached is None:
            cached = server.capabilities = await _compute(server)
        return JSONResponse(cached)
    return await server.guarded(request, "capabilities", work)


async def _compute(server) -> dict:
    module = server.model.module
    config = getattr(module, "config", None)
    arch = getattr(config, "model_type", None) or type(module).__name__
    answer = {"model": server.name, "architecture": arch, "class": type(module).__name__}
    if not server.is_lm:
        return {**answer, "points": {}, "refused": {},
                "note": "semantic points are probed on language models; GET /v1/model lists this model's modules"}
    n_tokens = len(server.model.to_tokens(PROBE))
    try:
        n_layers = len(server.model.layers)
    except Exception as exc:  # noqa: BLE001 - no decoder layers found: say so
        return {**answer, "points": {}, "refused": {"layers": f"{type(exc).__name__}: {exc}"}}
    points, refused = await aio.to_thread(server.model.trace, PROBE, probe_points(n_layers, n_tokens))
    return {**answer, "layers": n_layers, "probe": {"prompt": PROBE, "tokens": n_tokens},
            "points": points, "refused": refused}
