"""Named interventions for ``asyncinterp serve --interventions examples/serve_interventions.py``.

The server calls ``register(server)``. Each intervention is an ordinary
``async def`` taking the model envoy first; its other parameters are typed, and
the server validates what clients send against these types (and ranges) before
any model work. They work for ``trace`` (one pass) and ``generate`` (every step).
"""

from typing import Annotated, Literal, Optional

import torch

from asyncinterp.serve import emit
from asyncinterp.serve.http.app import ModulePath, Range


def _tensor(out):
    return out[0] if isinstance(out, tuple) else out


async def logit_lens(m, layers: Annotated[list[int], Range(0, 1000)], k: Annotated[int, Range(1, 20)] = 5):
    """Top-k tokens read off the residual stream after each listed layer (final norm + unembedding)."""
    blocks = m.model.layers
    want = sorted(set(i for i in layers if i < len(blocks)))
    out = {}
    for i in want:
        h = _tensor(await blocks[i].output)[:, -1]
        logits = m.lm_head(m.model.norm(h))
        out[i] = logits.softmax(-1).topk(k).indices
    return out


async def scale_layer(m, module: ModulePath, factor: Annotated[float, Range(-10, 10)] = 0.0,
                      report: Literal["top1", "none"] = "top1", position: Optional[int] = None):
    """Multiply a module's output by ``factor`` (at ``position`` or everywhere) at every step."""
    target = m
    for part in module.split("."):
        target = target.child(part)
    top = []
    async for step in m.steps():
        h = _tensor(await target.output)
        if position is None:
            h.mul_(factor)
        else:
            h[:, position].mul_(factor)
        if report == "top1":
            logits = await m.lm_head.output
            top.append(int(logits[0, -1].argmax()))
            emit({"step": step, "top1": top[-1]})          # streamed to the client as it happens
    return top


def register(server):
    server.intervention("logit_lens")(logit_lens)
    server.intervention("scale_layer")(scale_layer)
