"""Overhead of reading every denoiser block at every step: DiffusionModel vs hand-written torch hooks.

    PYTHONPATH=src python benchmarks/diffusion_overhead.py [--repeats 15] [--steps 4]

On the tiny offline pipelines (asyncinterp.models.tiny_diffusion): the plain
pipeline call, the call with one forward hook per block appending its output,
and ``model.generate`` with an intervention awaiting every block's output in
every step. Prints median CPU times in milliseconds (one torch thread, the
three run round-robin). The tiny models make the fixed
per-hook costs visible; on real checkpoints compute dominates.
"""

import argparse
import statistics
import time

import torch

import asyncinterp as ai
from asyncinterp.models.tiny_diffusion import tiny_pixart, tiny_sd


def blocks_of(name, root):
    if name == "unet":
        return [*root.down_blocks, root.mid_block, *root.up_blocks]
    return list(root.transformer_blocks)


def medians_ms(fns, repeats):
    """Median CPU time (ms, one torch thread) of each of ``fns``, run round-robin so load noise hits all alike."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            t = time.process_time()
            fn()
            out.append((time.process_time() - t) * 1e3)
    return [statistics.median(t) for t in times]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    cases = {"unet": (tiny_sd, {}),
             "transformer": (tiny_pixart, dict(clean_caption=False, use_resolution_binning=False,
                                               max_sequence_length=16))}
    for name, (build, extra) in cases.items():
        pipe = build()
        model = ai.DiffusionModel(pipe)
        kw = dict(height=8, width=8, guidance_scale=3.0, num_inference_steps=args.steps, output_type="np", **extra)
        modules = blocks_of(name, getattr(pipe, name))

        def plain():
            pipe(prompt=["a cat"], generator=torch.Generator().manual_seed(0), **kw)

        def hooked():
            seen = []
            handles = [m.register_forward_hook(lambda mod, a, o: seen.append(o)) for m in modules]
            try:
                plain()
            finally:
                for h in handles:
                    h.remove()

        async def read_all(m):
            seen = []
            async for _ in m.steps():
                for block in blocks_of(name, getattr(m, name)):
                    seen.append(await block.output)
            return len(seen)

        def ours():
            model.generate("a cat", read_all, seed=0, **kw)

        base, hand, mine = medians_ms([plain, hooked, ours], args.repeats)
        print(f"{name:12s} {len(modules)} blocks x {args.steps} steps: plain {base:.1f} ms, hand-written hooks "
              f"{hand:.1f} ms (+{hand - base:.1f}), DiffusionModel {mine:.1f} ms (+{mine - base:.1f})")


if __name__ == "__main__":
    main()
