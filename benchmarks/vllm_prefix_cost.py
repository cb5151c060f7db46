"""What a request with an intervention pays for its own KV blocks (no prefix-cache hits), on vLLM.

    python benchmarks/vllm_prefix_cost.py                 # SmolLM2-135M, prompts of 64 / 256 / 448 tokens

A plain request whose prompt is already in vLLM's prefix cache computes only
the last, partial block; a request with an intervention gets a cache salt of
its own and recomputes the whole prompt (see docs/vllm.md, "Prefix caching
and interventions"). Per prompt length: the median time of a one-token
generation, plain with the prompt cached, plain with caching defeated (a
fresh prompt each round), and with a do-nothing intervention (salted).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]   # benchmarks/vllm.py is not vllm


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--lengths", default="64,256,448")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import asyncinterp as ai
    model_dir = args.model_dir
    if model_dir is None:
        from asyncinterp.models.hf.bundled import smollm2_dir
        model_dir = str(smollm2_dir())
    vm = ai.VLLM(model_dir, dtype="float32", max_model_len=512, seed=0, enable_prefix_caching=True,
                 kv_cache_memory_bytes=1 << 30)

    async def nothing(m):
        await m.logits

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()
    print("| prompt tokens | plain, cached (ms) | plain, uncached (ms) | intervened, own blocks (ms) | cached tokens |")
    print("|---:|---:|---:|---:|---:|")
    try:
        for n in (int(x) for x in args.lengths.split(",")):
            base = [words[i % len(words)] for i in range(n)]
            prompt = vm.tokenizer(" ".join(base))["input_ids"][:n]
            vm.generate(prompt, max_new_tokens=1)
            times = {"cached": [], "uncached": [], "intervened": []}
            cached = None
            for r in range(args.rounds):
                t = time.perf_counter()
                inv = vm.generate(prompt, max_new_tokens=1)
                times["cached"].append(time.perf_counter() - t)
                cached = inv.cached_tokens
                fresh = [(x + 1 + r) % 1000 + 100 for x in prompt]
                t = time.perf_counter()
                vm.generate(fresh, max_new_tokens=1)
                times["uncached"].append(time.perf_counter() - t)
                t = time.perf_counter()
                vm.generate(prompt, nothing, max_new_tokens=1)
                times["intervened"].append(time.perf_counter() - t)
            med = {k: 1000 * statistics.median(v) for k, v in times.items()}
            print(f"| {n} | {med['cached']:.1f} | {med['uncached']:.1f} | {med['intervened']:.1f} | {cached} |",
                  flush=True)
    finally:
        vm.close()


if __name__ == "__main__":
    main()
