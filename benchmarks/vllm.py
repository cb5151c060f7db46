"""vLLM generation throughput: plain vLLM vs asyncinterp runs with per-step interventions.

    python benchmarks/vllm.py                    # SmolLM2-135M, batch 16, 32 new tokens (~2-3 min on 2 cores)
    python benchmarks/vllm.py --tiny --quick     # tiny random Llama, smoke run
    python benchmarks/vllm.py --out vllm         # also write benchmarks/results/vllm.{json,md}

Cases (same prompts, greedy, ``ignore_eos`` so every request makes exactly
``--tokens`` tokens; one engine for all of them):

* ``plain``       -- ``llm.generate(prompts, params)``: vLLM's own API, no asyncinterp;
* ``hooks``       -- the same with one hand-written forward hook on the layer that
                     slices every request's rows out of the flat batch each step
                     (the floor for a per-step read);
* ``ai: none``    -- ``model.generate`` with one invoke per prompt, no intervention
                     (asyncinterp's driver loop only);
* ``ai: read``    -- each invoke reads the layer's output at every step
                     (``async for _ in m.steps(): await m.model.layers[L].output``);
* ``ai: hidden``  -- each invoke reads the residual stream ``layers[L].hidden``
                     (folds ``residual`` into ``mlp_out``: two extra tensor ops);
* ``ai: resid_mid`` -- each invoke reads the semantic point ``layers[L].resid_mid`` (the
                     residual stream between attention and MLP: the post-attention norm's
                     ``(x, residual)`` inputs, folded) at every step;
* ``ai: steer``   -- each invoke adds a vector to ``layers[L].hidden`` at every step.

Timing: warm-up, then rounds; in every round each case runs once, in a
freshly shuffled order. Reported per case: the best (minimum) and the median
seconds per generate call, tokens/s at the best time, the throughput ratio to
``plain`` of the best times, and the median of the per-round (paired) ratios.
vLLM's CPU threads are pinned to cores and wait for each other at every op,
so other processes on the machine make single timings vary by 10x and more;
the best-of-rounds time is the robust number there (as ``timeit`` does), the
medians show the spread. The load average is printed with the results.
Targets: ``ai: read`` and ``ai: resid_mid`` >= 0.9x plain at batch 16.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

# this file is named vllm.py: keep its folder off the import path, or `import vllm` would import it
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import asyncinterp as ai  # noqa: E402

BASE_PROMPTS = [
    "The capital of France is", "Once upon a time", "The quick brown fox", "In the beginning",
    "My favourite colour is", "The best way to learn Python is", "Water boils at", "The moon is",
    "A good breakfast includes", "The history of Rome", "Cats and dogs are", "The weather today is",
    "To be or not to be", "The largest planet in the solar system is", "Music makes people", "Scientists discovered",
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2-135M")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per request")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--layer", type=int, default=None, help="layer to read/steer (default: the middle one)")
    ap.add_argument("--quick", action="store_true", help="3 rounds, 16 tokens")
    ap.add_argument("--out", help="write benchmarks/results/OUT.{json,md}")
    ns = ap.parse_args(argv)
    if ns.quick:
        ns.rounds, ns.tokens = 3, 16

    if ns.tiny:
        import tempfile
        from asyncinterp.models.hf.bundled import tiny_llama_dir
        model_dir = tiny_llama_dir(Path(tempfile.mkdtemp(prefix="bench-vllm-")) / "tiny", seed=0)
        name = "tiny Llama (2 layers, hidden 64)"
    else:
        from asyncinterp.models.hf.bundled import smollm2_dir
        model_dir = smollm2_dir()
        name = "SmolLM2-135M-Instruct"

    load_start = os.getloadavg()[0]
    t0 = time.perf_counter()
    model = ai.VLLM(str(model_dir), dtype="float32", max_model_len=256, kv_cache_memory_bytes=256 << 20, seed=0)
    start_s = time.perf_counter() - t0
    llm = model.llm
    n_layers = len(model.model.layers)
    layer = n_layers // 2 if ns.layer is None else ns.layer
    hidden = model.model.layers[0].input_layernorm.module.weight.shape[0]
    prompts = [BASE_PROMPTS[i % len(BASE_PROMPTS)] + ("" if i < len(BASE_PROMPTS) else f" ({i})")
               for i in range(ns.batch)]
    from vllm import SamplingParams
    params = SamplingParams(max_tokens=ns.tokens, temperature=0.0, ignore_eos=True)
    direction = torch.randn(hidden, generator=torch.Generator().manual_seed(0)) * 0.5
    target = model.model.layers[layer]
    runner = model.llm_engine.model_executor.driver_worker.worker.model_runner

    async def read(m):
        async for _ in m.steps():
            await target.output

    async def read_hidden(m):
        async for _ in m.steps():
            await target.hidden

    async def read_resid_mid(m):
        async for _ in m.steps():
            await m.layers[layer].resid_mid

    async def steer(m):
        async for _ in m.steps():
            (await target.hidden).add_(direction)

    def plain():
        outs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def hooks():
        seen = []

        def hook(mod, args, out):
            n = runner.input_batch.num_reqs
            qsl = runner.query_start_loc.np
            h = out[0]
            for i in range(n):
                seen.append(h[int(qsl[i]):int(qsl[i + 1])])
            seen.clear()
        handle = target.module.register_forward_hook(hook)
        try:
            return plain()
        finally:
            handle.remove()

    def ai_run(fn):
        def go():
            with model.generate(max_new_tokens=ns.tokens, ignore_eos=True) as tr:
                invs = [tr.invoke(p, *([fn] if fn else [])) for p in prompts]
            return sum(len(i.token_ids) for i in invs)
        return go

    cases = {
        "plain": plain,
        "hooks": hooks,
        "ai: none": ai_run(None),
        "ai: read": ai_run(read),
        "ai: hidden": ai_run(read_hidden),
        "ai: resid_mid": ai_run(read_resid_mid),
        "ai: steer": ai_run(steer),
    }
    expected = ns.batch * ns.tokens
    for label, fn in cases.items():          # warm-up, and every case makes all its tokens
        made = fn()
        if made != expected:
            raise SystemExit(f"{label}: made {made} tokens, expected {expected}")

    times = {k: [] for k in cases}
    cpu = {k: [] for k in cases}
    ratios = {k: [] for k in cases}
    cpu_ratios = {k: [] for k in cases}
    rng = random.Random(0)
    for r in range(ns.rounds):
        order = list(cases)
        rng.shuffle(order)
        this, this_cpu = {}, {}
        for label in order:
            t, c = time.perf_counter(), time.process_time()
            cases[label]()
            this[label] = time.perf_counter() - t
            this_cpu[label] = time.process_time() - c
        for label in cases:
            times[label].append(this[label])
            cpu[label].append(this_cpu[label])
            ratios[label].append(this["plain"] / this[label])
            cpu_ratios[label].append(this_cpu["plain"] / this_cpu[label])
        print(f"round {r + 1}/{ns.rounds}: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in this.items()),
              file=sys.stderr, flush=True)

    rows = []
    for label in cases:
        med = statistics.median(times[label])
        best = min(times[label])
        rows.append({"case": label, "best_s": best, "median_s": med, "tokens_per_s": expected / best,
                     "best_ratio_to_plain": min(times["plain"]) / best,
                     "ratio_to_plain": statistics.median(ratios[label]),
                     "ratio_min": min(ratios[label]), "ratio_max": max(ratios[label]),
                     "cpu_s": statistics.median(cpu[label]),
                     "cpu_ratio_to_plain": statistics.median(cpu_ratios[label])})
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    meta = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "model": name, "batch": ns.batch, "new_tokens": ns.tokens, "layer": layer, "rounds": ns.rounds,
        "engine_start_s": round(start_s, 1), "python": platform.python_version(), "torch": torch.__version__,
        "vllm": __import__("vllm").__version__, "cpus": os.cpu_count(),
        "load_avg_1min_at_start": load_start, "load_avg_1min_at_end": load,
    }
    table = _table(rows, meta)
    print(table)
    if ns.out:
        out = Path(__file__).parent / "results"
        out.mkdir(exist_ok=True)
        (out / f"{ns.out}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        (out / f"{ns.out}.md").write_text(table + "\n")
    model.close()
    return 0


def _load(x) -> str:
    return "?" if x is None else f"{x:.2f}"


def _table(rows, meta) -> str:
    lines = [
        f"vLLM generation throughput: {meta['model']}, batch {meta['batch']}, {meta['new_tokens']} new tokens "
        f"per request, layer {meta['layer']}, {meta['rounds']} rounds (vllm {meta['vllm']}, torch {meta['torch']}, "
        f"{meta['cpus']} CPUs)",
        "",
        f"load average (1 min) at the start: {_load(meta.get('load_avg_1min_at_start'))}, at the end: "
        f"{_load(meta['load_avg_1min_at_end'])}",
        "",
        "| case | best s / generate | tokens/s (best) | throughput vs plain (best) | median s | "
        "paired ratio (median, min-max) | process CPU time vs plain (median) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['case']} | {r['best_s']:.3f} | {r['tokens_per_s']:.0f} | "
                     f"**{r['best_ratio_to_plain']:.2f}x** | {r['median_s']:.3f} | "
                     f"{r['ratio_to_plain']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) | "
                     f"{r['cpu_ratio_to_plain']:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
