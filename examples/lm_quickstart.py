"""Read, edit and replace activations of a language model; the same from asyncio with atrace.

    python examples/lm_quickstart.py [--model tiny]
"""

import asyncio

import torch

from _common import load_model

model = load_model(__doc__)
prompt = "The capital of France is"


async def next_token(m):
    """Read: the logits of the last position."""
    logits = await m.lm_head.output
    return model.decode(logits[0, -1].argmax())


async def ablate_mlp(m):
    """Edit in place: zero the MLP of layer 0, then read the prediction."""
    out = await m.model.layers[0].mlp.output
    out[:] = 0
    return model.decode((await m.lm_head.output)[0, -1].argmax())


MID = len(model.model.layers) // 2


async def swap_last(m):
    """Replace: give the middle layer a new output (the last position's state copied from the first)."""
    h = await m.model.layers[MID].output
    new = h.clone()
    new[:, -1] = h[:, 0]
    m.model.layers[MID].output = new
    return model.decode((await m.lm_head.output)[0, -1].argmax())


print("next token:        ", repr(model.trace(prompt, next_token)))
print("layer 0 MLP zeroed:", repr(model.trace(prompt, ablate_mlp)))
print(f"layer {MID} replaced: ", repr(model.trace(prompt, swap_last)))


async def main():
    # In async code (web handlers, notebooks) the forward runs in a worker thread.
    results = [await model.atrace(p, next_token) for p in ("The capital of Italy is", "The capital of Spain is")]
    print("from asyncio:      ", results)

asyncio.run(main())
