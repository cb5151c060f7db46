"""Every-block reads on mixture-of-experts and LoRA models: asyncinterp against hand-written torch hooks.

    python benchmarks/families_moe.py              # ~2 min on 2 cores
    python benchmarks/families_moe.py --quick      # smoke run (~30 s)
    python benchmarks/families_moe.py --out families_moe   # also write benchmarks/results/families_moe.{json,md}

Models (transformers, CPU, float32, a 12-token prompt as token ids, ``ai.wrap``
on the module so every system makes the same model call):

* ``mixtral-tiny`` / ``qwen2_moe-tiny``: :func:`asyncinterp.models.hf.tiny_moe.tiny_moe`
  (2 layers, 4 experts, top-2). Cases: every block's router logits and routed
  output (hand-written: forward hooks on each ``gate`` and ``experts`` that keep
  ``out[0]`` and the output; asyncinterp: ``await mlp.router`` and
  ``await mlp.routed`` per layer, shown ``[b, n, ...]``); every block's
  ``per_expert`` (hand-written: a hook on ``experts`` computing every expert on
  its input with the same einsum); every block's ``.output`` (plain module points).
* ``llama-tiny + LoRA``: :func:`asyncinterp.models.hf.lora.tiny_lora_llama`
  (adapter ``red`` active). Case: every layer's ``q_proj.lora_A["red"]`` output.

Timing uses ``overhead.time_case`` (interleaved rounds in shuffled order,
medians, paired ratios with a distribution-free 95% CI). Each system is
checked to read what the hand-written hooks read before timing.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import overhead  # noqa: E402  (the timing harness)

import asyncinterp as ai  # noqa: E402
from asyncinterp.hooks.moe import _each_expert  # noqa: E402
from asyncinterp.models.hf.lora import tiny_lora_llama  # noqa: E402
from asyncinterp.models.hf.tiny_moe import tiny_moe  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog and runs far away"


def hooked(pairs, call):
    """Run ``call()`` with forward hooks ``(module, fn(out, args) -> value)``; returns the values in call order."""
    box = []
    hs = [m.register_forward_hook(lambda mod, args, out, f=f: box.append(f(out, args))) for m, f in pairs]
    try:
        call()
    finally:
        for h in hs:
            h.remove()
    return box


def moe_cases(family):
    model, tok = tiny_moe(family)
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    wrapped = ai.wrap(model)
    blocks = [layer.mlp for layer in model.model.layers]
    n = ids.shape[1]

    def plain():
        return model(ids)

    def hooks_router():
        pairs = []
        for b in blocks:
            pairs.append((b.gate, lambda out, a: out[0].view(1, n, -1)))
            pairs.append((b.experts, lambda out, a: out.view(1, n, -1)))
        return hooked(pairs, plain)

    async def ai_router(m):
        vals = []
        for layer in m.model.layers:
            vals.append(await layer.mlp.router)
            vals.append(await layer.mlp.routed)
        return vals

    def hooks_each():
        return hooked([(b.experts, lambda out, a, e=b.experts: _each_expert(e, a[0]).view(1, n, e.num_experts, -1))
                       for b in blocks], plain)

    async def ai_each(m):
        return [await layer.mlp.per_expert for layer in m.model.layers]

    def hooks_output():
        return hooked([(b, lambda out, a: out) for b in blocks], plain)

    async def ai_output(m):
        return [await layer.mlp.output for layer in m.model.layers]

    cases = []
    for label, hooks, fn in (("router + routed, every block", hooks_router, ai_router),
                             ("per_expert, every block", hooks_each, ai_each),
                             (".output of every MoE block", hooks_output, ai_output)):
        cases.append({"model": f"{family}-tiny", "case": label, "check": (hooks, lambda fn=fn: wrapped.trace(ids, fn)),
                      "systems": {"plain": plain, "hooks": hooks, "asyncinterp": lambda fn=fn: wrapped.trace(ids, fn)}})
    return cases


def lora_cases():
    pm, tok = tiny_lora_llama()
    base = pm.get_base_model()
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    wrapped = ai.wrap(base)
    parts = [layer.self_attn.q_proj.lora_A["red"] for layer in base.model.layers]

    def plain():
        return base(ids)

    def hooks():
        return hooked([(p, lambda out, a: out) for p in parts], plain)

    async def read(m):
        return [await layer.self_attn.q_proj.lora_A["red"].output for layer in m.model.layers]

    def run():
        return wrapped.trace(ids, read)
    return [{"model": "llama-tiny + LoRA", "case": "lora_A output, every layer", "check": (hooks, run),
             "systems": {"plain": plain, "hooks": hooks, "asyncinterp": run}}]


def check(case):
    hooks, ours = case["check"]
    want, got = hooks(), ours()
    assert len(want) == len(got), (case["case"], len(want), len(got))
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    rng = random.Random(0)
    budget, min_rounds, max_rounds = (3, 6, 20) if args.quick else (12, 20, 200)
    cases = moe_cases("mixtral") + moe_cases("qwen2_moe") + lora_cases()
    rows = []
    for case in cases:
        check(case)
        case["name"] = case["case"][:9]
        samples, rounds, inner = overhead.time_case(case, budget, min_rounds, max_rounds, rng, lambda *a: None)
        cpu = samples["cpu"]
        med = {k: overhead._median(v) for k, v in cpu.items()}
        rows.append({"model": case["model"], "case": case["case"], "rounds": rounds,
                     "plain_us": med["plain"], "hooks_us": med["hooks"], "asyncinterp_us": med["asyncinterp"],
                     "ai_x_hooks": overhead.summarize(cpu, "asyncinterp", "hooks", "ratio"),
                     "ai_minus_hooks_us": overhead.summarize(cpu, "asyncinterp", "hooks", "diff"),
                     "hooks_x_plain": overhead.summarize(cpu, "hooks", "plain", "ratio")})
        r = rows[-1]
        print(f"{r['model']:<18} {r['case']:<30} plain {r['plain_us']:8.0f} µs  hooks {r['hooks_us']:8.0f} µs  "
              f"asyncinterp {r['asyncinterp_us']:8.0f} µs  ai/hooks {r['ai_x_hooks'][0]:.3f}x "
              f"[{r['ai_x_hooks'][1]:.3f}, {r['ai_x_hooks'][2]:.3f}]  +{r['ai_minus_hooks_us'][0]:.0f} µs", flush=True)
    lines = ["| model | case | plain | hand-written hooks | asyncinterp | asyncinterp / hooks (95% CI) | asyncinterp − hooks |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        x, lo, hi = r["ai_x_hooks"]
        lines.append(f"| {r['model']} | {r['case']} | {r['plain_us']:.0f} µs | {r['hooks_us']:.0f} µs | "
                     f"{r['asyncinterp_us']:.0f} µs | {x:.3f}x [{lo:.3f}, {hi:.3f}] | {r['ai_minus_hooks_us'][0]:+.0f} µs |")
    table = "\n".join(lines)
    print("\n(cpu clock: thread time of the calling thread, medians over rounds)\n" + table)
    if args.out:
        out = HERE / "results"
        out.mkdir(exist_ok=True)
        (out / f"{args.out}.json").write_text(json.dumps(rows, indent=1, default=float))
        (out / f"{args.out}.md").write_text("# benchmarks/families_moe.py\n\n(cpu clock, medians)\n\n" + table + "\n")


if __name__ == "__main__":
    main()
