"""Overhead of reading every block of a vision-language model: VisionLanguageModel vs hand-written torch hooks.

    PYTHONPATH=src python benchmarks/families_vlm.py [--repeats 41] [--out]

On the tiny offline models (asyncinterp.models.hf.tiny_vision: LLaVA and
Qwen2-VL, one 20x30 image plus a short prompt), every system does the same
reads: the output of every vision-tower block, of the projector and of every
language-model layer, in one forward.

* plain: ``hf_model(**inputs)`` on the processor's output;
* hooks: the same call with one hand-written ``register_forward_hook`` per
  block appending its output (added and removed around each call): the floor;
* ai: ``model.trace(inputs, read_all)`` with the processor's output as the
  invoke's input, an ``async def`` awaiting every block's output;
* ai (text+image): ``model.trace(text, read_all, images=[img])``: the
  processor runs inside the run; compared with "hooks (text+image)", the
  hooks run plus the same processor call.

Before timing, the reads of ai and hooks are checked equal. Times are medians
of CPU time (``time.process_time``, one torch thread) over rounds in which
the systems run round-robin, so load noise hits all alike; ratios are
medians of the per-round ratios. ``--out`` writes
benchmarks/results/families_vlm.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import asyncinterp as ai
from asyncinterp.models.hf.tiny_vision import random_image, tiny_llava, tiny_qwen2_vl

HERE = Path(__file__).resolve().parent


def vision_blocks(hf, family):
    return list(hf.model.vision_tower.encoder.layers if family == "llava" else hf.model.visual.blocks)


def blocks(hf, family):
    proj = hf.model.multi_modal_projector if family == "llava" else hf.model.visual.merger
    return vision_blocks(hf, family) + [proj] + list(hf.model.language_model.layers)


def first(x):
    return x[0] if isinstance(x, tuple) else x


def rounds(fns, repeats):
    """Per-round CPU times (ms) of each of ``fns``, run round-robin after a warm-up."""
    for fn in fns:
        fn()
        fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            t = time.process_time()
            fn()
            out.append((time.process_time() - t) * 1e3)
    return times


def text_reference(repeats):
    """The same measurement on a text model of the same language-model size (``LanguageModel`` on tiny_llama)."""
    from asyncinterp.models.hf.bundled import tiny_llama
    from asyncinterp.models.hf.tiny_vision import TEXT
    hf, tok = tiny_llama(**{k: v for k, v in TEXT.items() if k != "max_position_embeddings"})
    model = ai.LanguageModel(hf, tok)
    inputs = dict(tok(["A prompt of about twenty tokens, as long as the image prompts of the tiny models"],
                      return_tensors="pt"))
    layers = list(hf.model.layers)

    def plain():
        return hf(**inputs)

    def hooked():
        seen = []
        handles = [m.register_forward_hook(lambda mod, a, o: seen.append(first(o))) for m in layers]
        try:
            hf(**inputs)
        finally:
            for h in handles:
                h.remove()

    async def read_all(m):
        return [await layer.output for layer in m.model.layers]

    def ours():
        return model.trace(inputs, read_all)

    times = rounds([plain, hooked, ours], repeats)
    base, hand, mine = (statistics.median(t) for t in times)
    ratio = statistics.median(m / h for m, h in zip(times[2], times[1]))
    diff = statistics.median(m - h for m, h in zip(times[2], times[1]))
    return (f"| text only (LanguageModel, tiny Llama of the same size) | {len(layers)} LM | {base:.2f} | {hand:.2f} | "
            f"{mine:.2f} | {ratio:.2f}x | {diff:+.2f} | | | |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--out", action="store_true", help="write benchmarks/results/families_vlm.md")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    lines = ["| family | blocks read | plain ms | hooks ms | ai ms | ai / hooks | ai - hooks ms | "
             "hooks (text+image) ms | ai (text+image) ms | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for family, build in (("llava", tiny_llava), ("qwen2_vl", tiny_qwen2_vl)):
        hf, processor = build()
        model = ai.VisionLanguageModel(hf, processor)
        text = model.image_placeholder + " What is in the picture?"
        image = random_image(20, 30, seed=1)
        inputs = dict(processor(text=[text], images=[image], return_tensors="pt"))
        modules = blocks(hf, family)
        n_vision = len(vision_blocks(hf, family))

        def plain():
            return hf(**inputs)

        def hooked(raw=False):
            seen = []
            handles = [m.register_forward_hook(lambda mod, a, o: seen.append(first(o))) for m in modules]
            try:
                call = dict(processor(text=[text], images=[image], return_tensors="pt")) if raw else inputs
                hf(**call)
            finally:
                for h in handles:
                    h.remove()
            return seen

        async def read_all(m):
            seen = []
            tower = m.vision_tower.encoder.layers if m.family == "llava" else m.vision_tower.blocks
            for block in tower:
                seen.append(first(await block.output))
            seen.append(await m.projector.output)
            for layer in m.language_model.layers:
                seen.append(await layer.output)
            return seen

        def ours():
            return model.trace(inputs, read_all)

        def ours_raw():
            return model.trace(text, read_all, images=[image])

        for a, b in zip(ours(), hooked()):
            assert torch.equal(a, b), family
        times = rounds([plain, hooked, ours, lambda: hooked(True), ours_raw], args.repeats)
        base, hand, mine, hand_raw, mine_raw = (statistics.median(t) for t in times)
        ratio = statistics.median(m / h for m, h in zip(times[2], times[1]))
        diff = statistics.median(m - h for m, h in zip(times[2], times[1]))
        ratio_raw = statistics.median(m / h for m, h in zip(times[4], times[3]))
        lines.append(f"| {family} | {n_vision} vision + projector + {len(hf.model.language_model.layers)} LM "
                     f"| {base:.2f} | {hand:.2f} | {mine:.2f} | {ratio:.2f}x | {diff:+.2f} | {hand_raw:.2f} | "
                     f"{mine_raw:.2f} | {ratio_raw:.2f}x |")
        print(lines[-1], flush=True)
    lines.append(text_reference(args.repeats))
    print(lines[-1], flush=True)
    table = "\n".join(lines)
    print()
    print(table)
    if args.out:
        head = ("# Vision-language: every-block read vs hand-written hooks\n\n"
                f"`PYTHONPATH=src python benchmarks/families_vlm.py --repeats {args.repeats} --out` "
                "(tiny random LLaVA / Qwen2-VL, one 20x30 image, CPU time, one torch thread; medians of "
                "round-robin rounds, ratios are medians of per-round ratios).\n\n")
        (HERE / "results" / "families_vlm.md").write_text(head + table + "\n")


if __name__ == "__main__":
    main()
