"""Dynamic batching inside your own asyncio program: many tasks, each with its own intervention.

    python examples/serve_batcher.py              # bundled SmolLM2-135M-Instruct
    python examples/serve_batcher.py --model tiny # tiny random Llama (fast smoke run)

64 concurrent "requests" each steer a different layer by a different amount
and read the next-token distribution. The Batcher coalesces them into a few
shared forward passes; every request still gets exactly its own result (here
checked against running it alone).
"""

import asyncio
import functools
import time

import torch

from _common import load_model
from asyncinterp.serve import Batcher


async def steer_and_read(m, layer, strength):
    h = await m.model.layers[layer].output
    h[:, -1] += strength                     # only this request's rows
    logits = await m.lm_head.output
    return logits[:, -1].softmax(-1).max().item()


async def main(model):
    n_layers = len(model.model.layers)
    prompts = ["The capital of France is", "Water boils at a temperature of", "The largest planet is",
               "A group of crows is called a"]
    jobs = [(prompts[i % 4], i % n_layers, 0.5 * (i % 5)) for i in range(64)]
    async with Batcher(model, max_batch=32, max_wait_ms=5) as batcher:
        t0 = time.perf_counter()
        results = await asyncio.gather(*[
            batcher.trace(p, functools.partial(steer_and_read, layer=layer, strength=s)) for p, layer, s in jobs])
        elapsed = time.perf_counter() - t0
        stats = dict(batcher.stats)
    print(f"{len(jobs)} requests in {elapsed:.2f} s, {stats['batches']} forward passes "
          f"(largest batch {stats['max_batch_seen']})")
    worst = 0.0
    for (p, layer, s), got in zip(jobs[:8], results[:8]):
        alone = model.trace(p, functools.partial(steer_and_read, layer=layer, strength=s))
        worst = max(worst, abs(got - alone))
        print(f"  layer {layer:2d} strength {s:.1f}  p(top token) = {got:.4f}   alone: {alone:.4f}")
    print(f"largest difference to running alone: {worst:.2e}")


if __name__ == "__main__":
    model = load_model(__doc__.splitlines()[0])
    asyncio.run(main(model))
