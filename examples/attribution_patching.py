"""Attribution patching on SmolLM2-135M: which layer/position carries the answer?

Activation patching asks: if I copy the residual stream of layer L at
position P from a clean run into a corrupted run, how much of the clean
answer comes back? Doing that for every (L, P) costs one forward pass each.
Attribution patching (Nanda 2023) estimates all of them from one clean
forward and one corrupted forward + backward, with a first-order Taylor
expansion::

    effect(L, P) ~ (clean[L, P] - corrupt[L, P]) . d metric / d corrupt[L, P]

With asyncinterp that is: a cache of the clean run, and one intervention on
the corrupted run that reads every layer's output, waits for the gradient
at each one (``ai.spawn(layer.output.grad)``) and starts the backward pass
(``await m.backward(metric)``). Then the top entries are checked with real
activation patching (one more trace each).

Run: ``.venv/bin/python examples/attribution_patching.py`` (about 10 s on CPU).
"""

from __future__ import annotations

import time

import torch

import asyncinterp as ai
from asyncinterp.models import smollm2

CLEAN = "The capital of France is"
CORRUPT = "The capital of Italy is"
ANSWER, WRONG = " Paris", " Rome"
TOP = 6


def main():
    t0 = time.perf_counter()
    lm = smollm2()
    good, bad = lm.token_id(ANSWER), lm.token_id(WRONG)
    tokens = [lm.decode([t]) for t in lm.tokenizer(CORRUPT).input_ids]

    def metric(logits):
        return logits[0, -1, good] - logits[0, -1, bad]

    # 1. clean activations: the residual stream after every layer (standard names: m.layers)
    clean = lm.trace(CLEAN, ai.Cache("model.layers.*"))

    # 2. corrupted run: activations, their gradients, and the metric, in one intervention
    async def corrupted(m):
        acts, grads = [], []
        for layer in m.layers:
            acts.append((await layer.output).detach().clone())
            grads.append(await ai.spawn(layer.output.grad))   # resumed during the backward pass
        value = metric(await m.lm_head.output)
        await m.backward(value)
        return value.item(), acts, [await g for g in grads]

    corrupt_metric, acts, grads = lm.trace(CORRUPT, corrupted)
    clean_metric = lm.trace(CLEAN, _metric_of(metric))

    # 3. attribution[L, P] = (clean - corrupt) . grad, summed over the hidden dimension
    n_layers = len(acts)
    attribution = torch.stack([
        ((clean[f"model.layers.{i}.output"] - acts[i]) * grads[i]).sum(-1)[0] for i in range(n_layers)])

    # 4. check the top estimates with real activation patching
    order = attribution.flatten().abs().argsort(descending=True)[:TOP]
    rows = []
    for flat in order.tolist():
        layer, pos = divmod(flat, attribution.shape[1])
        patched = lm.trace(CORRUPT, _patch(metric, layer, pos, clean[f"model.layers.{layer}.output"]))
        rows.append((layer, pos, tokens[pos], attribution[layer, pos].item(), patched - corrupt_metric))

    print(f"SmolLM2-135M  clean {CLEAN!r}  corrupt {CORRUPT!r}")
    print(f"metric = logit({ANSWER!r}) - logit({WRONG!r}): clean {clean_metric:+.3f}, corrupt {corrupt_metric:+.3f}")
    print()
    print(f"{'rank':>4}  {'layer':>5}  {'pos':>3}  {'token':<10} {'attribution':>12}  {'actual patch':>12}")
    for rank, (layer, pos, tok, est, real) in enumerate(rows, 1):
        print(f"{rank:>4}  {layer:>5}  {pos:>3}  {tok!r:<10} {est:>+12.3f}  {real:>+12.3f}")
    print()
    print("attribution by layer (rows) and position (columns):")
    print("layer " + "".join(f"{t!r:>12}" for t in tokens))
    for layer in range(n_layers):
        print(f"{layer:>5} " + "".join(f"{v:>+12.2f}" for v in attribution[layer].tolist()))
    print(f"\n({time.perf_counter() - t0:.1f} s)")
    return attribution, rows


def _metric_of(metric):
    async def fn(m):
        return metric(await m.lm_head.output).item()
    return fn


def _patch(metric, layer, pos, clean_value):
    async def fn(m):
        h = await m.layers[layer].output
        h[:, pos] = clean_value[:, pos]
        return metric(await m.lm_head.output).item()
    return fn


if __name__ == "__main__":
    main()
