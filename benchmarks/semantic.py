"""Semantic points on transformers: what reading them costs, and that unused ones cost nothing.

    python benchmarks/semantic.py                      # gpt2-tiny, llama-tiny, SmolLM2 (~5 min on 2 cores)
    python benchmarks/semantic.py --quick              # smoke run, the two tiny models (~40 s)
    python benchmarks/semantic.py --before 99edd84^    # also time the library as it was before semantic points
    python benchmarks/semantic.py --out semantic       # also write benchmarks/results/semantic.{json,md}

Two cases per model, each timed in interleaved rounds with the harness of
``overhead.py`` (``time_case``: every system of a case runs ``inner`` calls per
round in a freshly shuffled order; medians over rounds; ratios are medians of
the per-round paired ratios with a distribution-free 95% CI):

* ``every layer``: plain forward; hand-written forward hooks reading every
  layer's output (the floor); ``trace`` reading every layer's ``.output``; and
  reading every layer's ``resid_post``, ``resid_pre``, ``resid_mid``.
  Target: ``resid_post`` at every layer <= 1.05x ``.output`` at every layer.
* ``unused``: the empty run and the every-layer ``.output`` read on a fresh
  ``ai.wrap`` against the same on a wrap where every semantic point of every
  layer was looked up *and awaited* in earlier runs (the points exist on the
  envoys; nothing may be left installed). Target: no measurable difference
  (the paired ratio's CI contains 1 and ends below 1.05, or lies below 1.01). With ``--before REV``,
  the library at git revision ``REV`` (``git archive``, imported under another
  name in the same process) runs the same two interventions in the same rounds.

Every system is checked to read exactly what the hand-written hooks read
(``torch.equal``) before timing.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import importlib
import io
import json
import math
import os
import platform
import random
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import overhead  # noqa: E402  (the timing harness)

import asyncinterp as ai  # noqa: E402

TARGET_RESID_POST = 1.05
TARGET_UNUSED = 1.01


def build_gpt2_tiny():
    spec = overhead.build_gpt2_tiny()
    spec["layers_of"] = lambda m: m.transformer.h
    return spec


def build_llama_tiny():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=12,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
                         attn_implementation="eager", bos_token_id=0, eos_token_id=0)
    module = LlamaForCausalLM(config).eval()
    x = torch.randint(0, 1024, (1, 16), generator=torch.Generator().manual_seed(1))
    return dict(name="llama-tiny", desc="Llama, 12 layers, hidden 64, 4 heads / 2 kv heads, vocab 1024, eager attn, "
                "1 x 16 tokens", module=module, x=x, layers_of=lambda m: m.model.layers)


def build_smollm2():
    from asyncinterp.models.hf.bundled import load_smollm2
    module, tok = load_smollm2()
    module.eval()
    x = tok("The Eiffel Tower is located in the city of Paris, which is", return_tensors="pt").input_ids
    return dict(name="smollm2", desc=f"SmolLM2-135M-Instruct (30 layers, hidden 576), 1 x {x.shape[1]} tokens",
                module=module, x=x, layers_of=lambda m: m.model.layers)


BUILDERS = {"gpt2-tiny": build_gpt2_tiny, "llama-tiny": build_llama_tiny, "smollm2": build_smollm2}


def load_before(rev: str):
    """The ``asyncinterp`` package at git revision ``rev``, imported as ``asyncinterp_before``."""
    repo = HERE.parent
    blob = subprocess.run(["git", "-C", str(repo), "archive", rev, "src/asyncinterp"], check=True,
                          capture_output=True).stdout
    root = Path(tempfile.mkdtemp(prefix="asyncinterp-before-"))
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(root, filter="data")
    (root / "src" / "asyncinterp").rename(root / "asyncinterp_before")
    sys.path.insert(0, str(root))
    return importlib.import_module("asyncinterp_before")


def _first(o):
    return o[0] if isinstance(o, tuple) else o


def make_cases(spec, before=None):
    module, x, layers_of = spec["module"], spec["x"], spec["layers_of"]
    blocks = list(layers_of(module))
    fresh = ai.wrap(module)
    touched = ai.wrap(module)

    async def read_output(m):
        return [_first(await b.output) for b in layers_of(m)]

    async def read_resid_post(m):
        return [await b.resid_post for b in layers_of(m)]

    async def read_resid_pre(m):
        return [await b.resid_pre for b in layers_of(m)]

    async def read_resid_mid(m):
        return [await b.resid_mid for b in layers_of(m)]

    async def empty(m):
        return None

    async def touch_all(m):            # every semantic point of every layer, awaited (in firing order)
        out = []
        for b in layers_of(m):
            out.append(await b.resid_pre)
            for name in ("q", "k", "v"):
                out.append(await getattr(b.attn, name))
            out.append(await b.attn.pattern)
            out.append(await b.resid_mid)
            out.append(await b.mlp.pre)
            out.append(await b.mlp.post)
            out.append(await b.resid_post)
        out.append(await m.logits)
        return out

    def hooks_read_all():
        return overhead.hooks_read(blocks, lambda: module(x), _first)

    def plain():
        return module(x)

    n_hooks = sum(len(mod._forward_hooks) + len(mod._forward_pre_hooks) for mod in module.modules())
    assert n_hooks == 0, "the model must start without hooks"
    for _ in range(2):
        touched.trace(x, touch_all)
    n_points = sum(len(e.points) for e in [touched] + [touched.layers[i] for i in range(len(blocks))])
    assert n_points > 0
    assert sum(len(mod._forward_hooks) + len(mod._forward_pre_hooks) for mod in module.modules()) == 0

    every_layer = {
        "plain": plain,
        "hooks": hooks_read_all,
        "ai .output": lambda: fresh.trace(x, read_output),
        "ai resid_post": lambda: fresh.trace(x, read_resid_post),
        "ai resid_pre": lambda: fresh.trace(x, read_resid_pre),
        "ai resid_mid": lambda: fresh.trace(x, read_resid_mid),
    }
    unused = {
        "plain": plain,
        "fresh: empty": lambda: fresh.trace(x, empty),
        "touched: empty": lambda: touched.trace(x, empty),
        "fresh: .output": lambda: fresh.trace(x, read_output),
        "touched: .output": lambda: touched.trace(x, read_output),
    }
    if before is not None:
        old = before.wrap(module)
        unused["before: empty"] = lambda: old.trace(x, empty)
        unused["before: .output"] = lambda: old.trace(x, read_output)

    # correctness: the same tensors as the hand-written hooks
    ref = hooks_read_all()
    for label in ("ai .output", "ai resid_post"):
        got = every_layer[label]()
        assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref)), label
    for label in ("touched: .output",) + (("before: .output",) if before is not None else ()):
        got = unused[label]()
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), label
    resid_pre = every_layer["ai resid_pre"]()
    assert all(torch.equal(a, b) for a, b in zip(resid_pre[1:], ref[:-1])), "resid_pre[i] = resid_post[i-1]"
    return {"every layer": every_layer, "unused": unused}


def paired(samples, a, b):
    return overhead.summarize(samples, a, b, "ratio")


def fmt_ci(stat):
    m, lo, hi = stat
    if math.isinf(lo):
        return f"{m:.3f}x (too few rounds for a CI)"
    return f"{m:.3f}x ({lo:.3f}…{hi:.3f})"


def verdict(stat, target):
    return overhead._verdict(stat, target)


def unused_verdict(stat):
    """PASS: no cost detected (the CI contains 1) and any cost is resolved below 5% (CI upper end <= 1.05);
    MISS: a cost is detected (the whole CI is above TARGET_UNUSED); UNRESOLVED: the noise is too large to say."""
    m, lo, hi = stat
    if math.isinf(lo):
        return "UNRESOLVED (too few rounds)"
    if lo > TARGET_UNUSED:
        return "MISS"
    if lo <= 1.0 <= hi <= 1.05 or hi <= TARGET_UNUSED:
        return "PASS"
    return "UNRESOLVED (CI too wide)"


def bench(spec, args, rng, log, before):
    cases = make_cases(spec, before)
    heavy = spec["name"] == "smollm2"
    budget = args.budget * (8.0 if heavy else 1.0)      # ~0.3 s per forward: enough rounds for a CI
    min_rounds = 7 if heavy else (8 if args.quick else 20)
    out = {"model": spec["name"], "desc": spec["desc"], "cases": {}}
    for cname, systems in cases.items():
        clocks, rounds, inner = overhead.time_case({"name": cname, "systems": systems}, budget, min_rounds, 20000,
                                                   rng, log, 1 if heavy else 30)
        gc.collect()
        entry = {"rounds": rounds, "inner": inner}
        for clock, smp in clocks.items():
            med = {n: overhead._median(v) for n, v in smp.items()}
            if cname == "every layer":
                ratios = {n: paired(smp, n, "ai .output") for n in systems if n.startswith("ai ")}
                ratios["hooks"] = paired(smp, "hooks", "ai .output")
                vs_plain = {n: paired(smp, n, "plain") for n in systems}
            else:
                pairs = [("touched: empty", "fresh: empty"), ("touched: .output", "fresh: .output")]
                if before is not None:
                    pairs += [("fresh: empty", "before: empty"), ("fresh: .output", "before: .output")]
                ratios = {f"{a} / {b}": paired(smp, a, b) for a, b in pairs}
                vs_plain = {n: paired(smp, n, "plain") for n in systems}
            entry[clock] = {"median_us": med, "ratios": ratios, "x_plain": vs_plain}
        out["cases"][cname] = entry
    return out


def tables(results, clock):
    lines = ["| model | reads at every layer | median µs | × plain | × `.output` at every layer (95% CI) |",
             "|---|---|---:|---:|---:|"]
    for r in results:
        c = r["cases"]["every layer"][clock]
        for n in ("plain", "hooks", "ai .output", "ai resid_post", "ai resid_pre", "ai resid_mid"):
            name = {"plain": "none (plain forward)", "hooks": "hand-written hooks, layer outputs",
                    "ai .output": "`layers[i].output`", "ai resid_post": "`layers[i].resid_post`",
                    "ai resid_pre": "`layers[i].resid_pre`", "ai resid_mid": "`layers[i].resid_mid`"}[n]
            ratio = "1" if n == "ai .output" else ("—" if n == "plain" else fmt_ci(c["ratios"][n]))
            xp = "1" if n == "plain" else f"{c['x_plain'][n][0]:.3f}"
            lines.append(f"| {r['model']} | {name} | {overhead._fmt_us(c['median_us'][n])} | {xp} | {ratio} |")
    lines += ["", "| model | intervention | median µs, fresh wrap | median µs, semantic points made and awaited "
              "before | paired ratio touched / fresh (95% CI) |" + (" median µs, before semantic points | paired ratio "
                                                             "now / before (95% CI) |" if _has_before(results) else ""),
              "|---|---|---:|---:|---:|" + ("---:|---:|" if _has_before(results) else "")]
    for r in results:
        c = r["cases"]["unused"][clock]
        for what, key in (("empty run", "empty"), ("`.output` at every layer", ".output")):
            row = (f"| {r['model']} | {what} | {overhead._fmt_us(c['median_us'][f'fresh: {key}'])} | "
                   f"{overhead._fmt_us(c['median_us'][f'touched: {key}'])} | "
                   f"{fmt_ci(c['ratios'][f'touched: {key} / fresh: {key}'])} |")
            if _has_before(results):
                row += (f" {overhead._fmt_us(c['median_us'][f'before: {key}'])} | "
                        f"{fmt_ci(c['ratios'][f'fresh: {key} / before: {key}'])} |")
            lines.append(row)
    return "\n".join(lines)


def _has_before(results):
    return any("before: empty" in r["cases"]["unused"]["wall"]["median_us"] for r in results)


def targets(results, clock):
    lines = []
    verdicts = {}
    for r in results:
        c = r["cases"]["every layer"][clock]
        stat = c["ratios"]["ai resid_post"]
        v = verdict(stat, TARGET_RESID_POST)
        verdicts[f"resid_post[{r['model']}]"] = v
        lines.append(f"{r['model']:<11} resid_post at every layer / .output at every layer (target <= "
                     f"{TARGET_RESID_POST}x): {fmt_ci(stat)}  {v}")
        u = r["cases"]["unused"][clock]["ratios"]
        for key in ("empty", ".output"):
            stat = u[f"touched: {key} / fresh: {key}"]
            v = unused_verdict(stat)
            verdicts[f"unused[{r['model']}, {key}]"] = v
            lines.append(f"{r['model']:<11} unused semantic points, {key:<7} touched / fresh (target: no cost: CI "
                         f"contains 1 and ends <= 1.05x): {fmt_ci(stat)}  {v}")
    return "\n".join(lines), verdicts


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--models", default=",".join(BUILDERS), help=f"comma list of {', '.join(BUILDERS)} "
                   "(default: all; --quick: the two tiny ones)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds of timing per case (default 6, --quick 1; x8 for smollm2)")
    p.add_argument("--before", metavar="REV", help="also time asyncinterp at git revision REV (e.g. 99edd84^)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="cpu",
                   help="clock of the tables: cpu (thread_time_ns, default: robust when other processes compete for "
                        "the cores) or wall (perf_counter_ns); both are recorded and judged")
    p.add_argument("--out", metavar="NAME", help="write benchmarks/results/NAME.{md,json}")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.budget is None:
        args.budget = 1.0 if args.quick else 6.0
    if args.quick and args.models == ",".join(BUILDERS):
        args.models = "gpt2-tiny,llama-tiny"
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    rng = random.Random(args.seed)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    before = load_before(args.before) if args.before else None
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    log(f"semantic points benchmark; load avg {load0:.2f}")
    results = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        spec = BUILDERS[name]()
        gc.collect()
        gc.freeze()
        log(f"  {name}")
        results.append(bench(spec, args, rng, log, before))
        del spec
        gc.unfreeze()
        gc.collect()
    load1 = os.getloadavg()[0]
    commit = subprocess.run(["git", "-C", str(HERE.parent), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    env = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "python": platform.python_version(),
           "torch": torch.__version__, "asyncinterp_commit": commit, "before": args.before,
           "cores": os.cpu_count(), "torch_threads": 1, "seconds": round(time.perf_counter() - t0, 1),
           "loadavg_at_start": load0, "loadavg_at_end": load1, "clock": args.clock,
           "mode": "quick" if args.quick else "full"}
    other = "cpu" if args.clock == "wall" else "wall"
    tgt, verdicts = targets(results, args.clock)
    tgt_other, verdicts_other = targets(results, other)
    models = "\n".join(f"- **{r['model']}**: {r['desc']}" for r in results)
    rounds = ", ".join(f"{r['model']} {c} {e['rounds']}×{e['inner']}" for r in results for c, e in r["cases"].items())
    md = (f"asyncinterp {commit}, torch {env['torch']}, Python {env['python']}, {env['cores']} cores, torch threads 1, "
          f"mode {env['mode']}, {env['seconds']} s, load avg {load0:.2f} at start / {load1:.2f} at end, "
          f"{env['date']}" + (f", before = {args.before}" if args.before else "") + f"\n\n{models}\n\n"
          f"Rounds × calls per round: {rounds}. Clock: {args.clock}.\n\n{tables(results, args.clock)}\n\n"
          f"Targets ({args.clock} clock):\n\n```\n{tgt}\n```\n\nSame on the {other} clock:\n\n```\n{tgt_other}\n```\n")
    print(md)
    if args.out:
        base = HERE / "results" / args.out
        base.with_suffix(".md").write_text(md)
        base.with_suffix(".json").write_text(json.dumps({"env": env, "verdicts": {args.clock: verdicts,
                                                                                  other: verdicts_other},
                                                         "results": results}, indent=1, default=str))
        log(f"wrote {base}.md/.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
