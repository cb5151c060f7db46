"""Overhead benchmark: asyncinterp vs plain forward, hand-written hooks and nnsight.

    python benchmarks/overhead.py               # full run (~3-4 min on 2 cores)
    python benchmarks/overhead.py --quick       # smoke run (~30 s)
    python benchmarks/overhead.py --out latest  # also write benchmarks/results/latest.{json,md}

Every system does the same reads/edits on the same inputs:

* plain     -- ``module(x)``, no interventions at all;
* hooks     -- hand-written ``register_forward_hook`` doing the same reads/edits,
               installed and removed around each call (the floor);
* asyncinterp -- ``ai.wrap(module).trace(x, fn)`` with an ``async def fn(m)``;
* nnsight   -- ``NNsight(copy_of_module)`` with ``with model.trace(x): ... .save()``
               (only when ``import nnsight`` works; never a dependency of the library).

nnsight instruments every module it wraps (it installs a controller as each
module's ``forward``), so it gets its own deep copy of each model with the same
weights; plain, hooks and asyncinterp share the pristine module (asyncinterp's
``wrap`` does not modify it).

Timing: ``torch.set_num_threads(1)``, grad disabled, warm-up, then interleaved
rounds: in every round each system of a case runs ``inner`` calls in a freshly
shuffled order and the per-call time is recorded. Times are medians over rounds;
ratios and differences are medians of the per-round (paired) ratios/differences,
with a distribution-free 95% confidence interval from order statistics. Before
timing, every case checks that asyncinterp (and nnsight) read exactly what the
hand-written hooks read (``torch.equal``).
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import gc
import json
import math
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

import asyncinterp as ai

try:  # bench-only comparison; the library never imports nnsight
    import nnsight
    from nnsight import NNsight
except Exception as _exc:  # noqa: BLE001 - any import failure means "not installed"
    nnsight = None
    NNsight = None
    NNSIGHT_STATUS = f"nnsight not installed ({type(_exc).__name__}: {_exc})".splitlines()[0][:120]
else:
    NNSIGHT_STATUS = f"nnsight {nnsight.__version__}"

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
K = 3            # the block read/edited in the single-point cases
N_INVOKES = 8

TARGETS = {
    "fixed_cost_us": 30.0,          # asyncinterp empty run minus plain forward
    "every_block_vs_hooks": 1.05,   # every-block read on the 12-block GPT-2, vs hand-written hooks
    "extra_invoke_us": 15.0,        # each extra invoke
}


# --------------------------------------------------------------------- models
class BatchedNNsight(NNsight if NNsight is not None else object):
    """NNsight over a module whose inputs batch along dim 0.

    nnsight's base ``NNsight`` refuses several invokes; overriding ``_batch_size``
    and ``_batch`` is its documented way to batch a plain module.
    """

    def _batch_size(self, *inputs, **kwargs):
        return inputs[0].shape[0] if inputs else 0

    def _batch(self, invokes, fn):
        if len(invokes) == 1:
            return invokes[0]
        return (torch.cat([args[0] for args, _ in invokes]),), {}


def build_mlp():
    torch.manual_seed(0)
    module = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(12)]).eval()
    x = torch.randn(1, 64)
    xs = [torch.randn(1, 64) for _ in range(N_INVOKES)]
    return dict(
        name="mlp12", desc="12 x (Linear(64,64)+ReLU), batch 1", module=module, x=x, xs=xs,
        layers=lambda m: m, out=lambda o: o)


def _gpt2(name, desc, **cfg):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(use_cache=False, attn_implementation="eager", **cfg)
    module = GPT2LMHeadModel(config).eval()
    vocab = config.vocab_size
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (1, 16), generator=g)
    xs = [torch.randint(0, vocab, (1, 16), generator=g) for _ in range(N_INVOKES)]
    return dict(name=name, desc=desc, module=module, x=x, xs=xs,
                layers=lambda m: m.transformer.h, out=lambda o: o.logits)


def build_gpt2_tiny():
    return _gpt2("gpt2-tiny", "GPT-2, 12 blocks, width 64, 4 heads, vocab 1024, eager attn, batch 1 x 16 tokens",
                 n_layer=12, n_embd=64, n_head=4, vocab_size=1024, n_positions=64,
                 bos_token_id=0, eos_token_id=0)


def build_gpt2_small():
    return _gpt2("gpt2-small", "GPT-2-small shape (12 x 768, vocab 50257), random weights, eager attn, 1 x 16 tokens",
                 n_layer=12, n_embd=768, n_head=12)


BUILDERS = {"mlp12": build_mlp, "gpt2-tiny": build_gpt2_tiny, "gpt2-small": build_gpt2_small}


# ---------------------------------------------------------------------- cases
def hooks_read(blocks, call, pick=None):
    """The floor for reads: a hand-written forward hook on each of ``blocks`` collecting its output
    (``pick(output)`` if given), installed and removed around ``call()``; returns what they collected."""
    box = []
    if pick is None:
        hs = [b.register_forward_hook(lambda mod, args, o: box.append(o)) for b in blocks]
    else:
        hs = [b.register_forward_hook(lambda mod, args, o: box.append(pick(o))) for b in blocks]
    try:
        call()
    finally:
        for h in hs:
            h.remove()
    return box


def make_cases(spec, with_nnsight):
    """Return ``(cases, extra)``.

    Each case is ``{"name", "systems": {system: fn}, "rows": [...], "checks": [(ref, other)]}``;
    every ``fn()`` returns what it read. ``extra`` holds correctness-only callables.
    """
    module, x, xs, layers, out_of = spec["module"], spec["x"], spec["xs"], spec["layers"], spec["out"]
    blocks = list(layers(module))
    x8 = torch.cat(xs)
    model = ai.wrap(module)

    nnmodel = None
    if with_nnsight:
        nnmodule = copy.deepcopy(module)
        nnmodel = BatchedNNsight(nnmodule)

    # --- interventions (asyncinterp) ---
    async def ai_empty(m):
        return None

    async def ai_read1(m):
        return await layers(m)[K].output

    async def ai_read_all(m):
        return [await b.output for b in layers(m)]

    async def ai_edit(m):
        h = await layers(m)[K].output
        h[:] = 0

    def ai_inv8():
        with model.trace() as tr:
            invs = [tr.invoke(xi, ai_read1) for xi in xs]
        return [inv.result for inv in invs]

    def ai_edit_output():  # correctness only: the model output after the edit
        with model.trace() as tr:
            tr.invoke(x, ai_edit)
        return out_of(tr.output)

    # --- hand-written hooks (the floor) ---
    def hooks_read1(inp=x):
        return hooks_read([blocks[K]], lambda: module(inp))[0]

    def hooks_read_all():
        return hooks_read(blocks, lambda: module(x))

    def _zero(mod, args, o):
        o[:] = 0

    def hooks_edit():
        h = blocks[K].register_forward_hook(_zero)
        try:
            return module(x)
        finally:
            h.remove()

    def hooks_inv8():
        inp = torch.cat(xs)
        h8 = hooks_read1(inp)
        return [h8[i:i + 1] for i in range(len(xs))]

    # --- nnsight, written the way its docs show ---
    def nn_empty():
        with nnmodel.trace(x):
            pass

    def nn_read1(inp=x):
        with nnmodel.trace(inp):
            h = layers(nnmodel)[K].output.save()
        return h

    def nn_read_all():
        with nnmodel.trace(x):
            hs = nnsight.save([b.output for b in layers(nnmodel)])
        return hs

    def nn_edit():
        with nnmodel.trace(x):
            layers(nnmodel)[K].output[:] = 0

    def nn_edit_output():  # correctness only
        with nnmodel.trace(x):
            layers(nnmodel)[K].output[:] = 0
            out = nnmodel.output.save()
        return out_of(out)

    def nn_inv8():
        with nnmodel.trace() as tracer:
            hs = nnsight.save([])
            for xi in xs:
                with tracer.invoke(xi):
                    hs.append(layers(nnmodel)[K].output)
        return hs

    def plain():
        return module(x)

    cases = []

    def add(case, systems, rows, checks):
        if nnmodel is None:
            systems = {k: v for k, v in systems.items() if not k.startswith("nnsight")}
            checks = [c for c in checks if not c[1].startswith("nnsight")]
        cases.append(dict(name=case, systems=systems, rows=rows, checks=checks))

    # rows: (label, ref_plain, ref_hooks, system columns: {"hooks":..,"asyncinterp":..,"nnsight":..})
    add("empty", {"plain": plain, "asyncinterp": lambda: model.trace(x, ai_empty), "nnsight": nn_empty},
        [("empty run", "plain", None, {"asyncinterp": "asyncinterp", "nnsight": "nnsight"})],
        [])
    add("read1", {"plain": plain, "hooks": hooks_read1, "asyncinterp": lambda: model.trace(x, ai_read1),
                  "nnsight": nn_read1},
        [("one read", "plain", "hooks", {"hooks": "hooks", "asyncinterp": "asyncinterp", "nnsight": "nnsight"})],
        [("hooks", "asyncinterp"), ("hooks", "nnsight")])
    add("read_all", {"plain": plain, "hooks": hooks_read_all, "asyncinterp": lambda: model.trace(x, ai_read_all),
                     "nnsight": nn_read_all},
        [("every block read", "plain", "hooks",
          {"hooks": "hooks", "asyncinterp": "asyncinterp", "nnsight": "nnsight"})],
        [("hooks", "asyncinterp"), ("hooks", "nnsight")])
    add("edit", {"plain": plain, "hooks": hooks_edit, "asyncinterp": lambda: model.trace(x, ai_edit),
                 "nnsight": nn_edit},
        [("one in-place edit", "plain", "hooks",
          {"hooks": "hooks", "asyncinterp": "asyncinterp", "nnsight": "nnsight"})],
        [("hooks_edit_out", "asyncinterp_edit_out"), ("hooks_edit_out", "nnsight_edit_out")])
    add("invokes", {"plain": lambda: module(x8),
                    "hooks": lambda: hooks_read1(x8), "hooks8": hooks_inv8,
                    "asyncinterp": lambda: model.trace(x8, ai_read1), "asyncinterp8": ai_inv8,
                    "nnsight": lambda: nn_read1(x8), "nnsight8": nn_inv8},
        [("1 invoke, batch 8, one read", "plain", "hooks",
          {"hooks": "hooks", "asyncinterp": "asyncinterp", "nnsight": "nnsight"}),
         (f"{N_INVOKES} invokes x batch 1, one read each", "plain", "hooks8",
          {"hooks": "hooks8", "asyncinterp": "asyncinterp8", "nnsight": "nnsight8"})],
        [("hooks", "asyncinterp"), ("hooks", "nnsight"), ("hooks8", "asyncinterp8"), ("hooks8", "nnsight8")])
    nn_call = (lambda: nnmodule(x)) if nnmodel is not None else None
    nn_env_call = (lambda: nnmodel(x)) if nnmodel is not None else None
    add("outside", {"plain": plain, "asyncinterp": lambda: module(x), "asyncinterp_env": lambda: model(x),
                    "nnsight": nn_call, "nnsight_env": nn_env_call},
        [("outside a run: module(x) after wrap", "plain", None, {"asyncinterp": "asyncinterp", "nnsight": "nnsight"}),
         ("outside a run: wrapper(x)", "plain", None, {"asyncinterp": "asyncinterp_env", "nnsight": "nnsight_env"})],
        [("plain", "asyncinterp"), ("plain", "asyncinterp_env"), ("plain", "nnsight"), ("plain", "nnsight_env")])

    extra = {"hooks_edit_out": lambda: out_of(hooks_edit()), "asyncinterp_edit_out": ai_edit_output,
             "nnsight_edit_out": nn_edit_output if nnmodel is not None else None,
             "plain_out": lambda: out_of(plain())}
    return cases, extra


# ------------------------------------------------------------------ checking
def _flat(v):
    if isinstance(v, torch.Tensor):
        return [v]
    if hasattr(v, "logits"):
        return [v.logits]
    if isinstance(v, (list, tuple)):
        return [t for item in v for t in _flat(item)]
    raise TypeError(f"cannot compare {type(v).__name__}")


def check_case(case, extra):
    fns = dict(case["systems"])
    fns.update({k: v for k, v in extra.items() if v is not None})
    for ref, other in case["checks"]:
        a, b = _flat(fns[ref]()), _flat(fns[other]())
        ok = len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b))
        if not ok:
            raise AssertionError(f"{case['name']}: {other} did not read what {ref} read")
    if case["name"] == "edit":  # the edit must change something
        if torch.equal(extra["plain_out"](), extra["hooks_edit_out"]()):
            raise AssertionError("edit case: the in-place edit did not change the model output")


# -------------------------------------------------------------------- timing
def _median(v):
    s = sorted(v)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _median_ci(v):
    """Median with a distribution-free ~95% confidence interval (order statistics)."""
    s = sorted(v)
    n = len(s)
    if n < 6:  # too few rounds for a confidence interval
        return _median(s), -math.inf, math.inf
    half = 1.96 * math.sqrt(n) / 2
    lo = max(0, int(math.floor(n / 2 - half)))
    hi = min(n - 1, int(math.ceil(n / 2 + half)))
    return _median(s), s[lo], s[hi]


def time_case(case, budget_s, min_rounds, max_rounds, rng, log, warm_rounds=30):
    """Interleaved rounds; returns ``({"wall": {system: [µs]}, "cpu": {...}}, rounds, inner)``."""
    systems = case["systems"]
    names = list(systems)
    # warm up every system, then size ``inner`` so an average sample lasts about 0.5 ms
    t0 = time.perf_counter()
    for f in systems.values():
        f()
    one = max(time.perf_counter() - t0, 1e-6) / len(names)
    for _ in range(max(0, min(warm_rounds, int(0.3 / one)))):
        for n in names:
            systems[n]()
    passes = []
    for _ in range(3):
        t0 = time.perf_counter_ns()
        for n in names:
            systems[n]()
        passes.append((time.perf_counter_ns() - t0) / len(names))
        if passes[-1] > 20_000_000:  # big model: one pass is enough
            break
    inner = max(1, int(round(500_000 / max(min(passes), 1))))
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    order = names[:]
    deadline = time.perf_counter() + budget_s
    rounds = 0
    perf = time.perf_counter_ns
    tt = time.thread_time_ns
    while rounds < max_rounds and (rounds < min_rounds or time.perf_counter() < deadline):
        rng.shuffle(order)
        for n in order:
            f = systems[n]
            t = perf()
            c = tt()
            for _ in range(inner):
                f()
            c = tt() - c
            t = perf() - t
            wall[n].append(t / inner / 1000.0)  # µs per call
            cpu[n].append(c / inner / 1000.0)
        rounds += 1
    log(f"    {case['name']:<9} {rounds:>5} rounds x {inner} calls")
    return {"wall": wall, "cpu": cpu}, rounds, inner


def summarize(samples, a, b, kind):
    """Paired statistic over rounds: ``kind`` 'ratio' (a/b) or 'diff' (a-b, µs)."""
    if kind == "ratio":
        per = [p / q for p, q in zip(samples[a], samples[b])]
    else:
        per = [p - q for p, q in zip(samples[a], samples[b])]
    return _median_ci(per)


# ------------------------------------------------------------------- running
def summarize_case(case, samples):
    """Rows (medians, paired ratios/differences) and derived numbers for one clock."""
    med = {n: _median(v) for n, v in samples.items()}
    rows = []
    for label, ref_plain, ref_hooks, cols in case["rows"]:
        floor = ref_hooks or ref_plain
        row = {"case": label, "plain_us": med[ref_plain],
               "hooks_us": med[ref_hooks] if ref_hooks else None, "floor": floor}
        for col, sysname in cols.items():
            if sysname not in samples:
                continue
            row[f"{col}_us"] = med[sysname]
            if col != "hooks":
                row[f"{col}_x_plain"] = summarize(samples, sysname, ref_plain, "ratio")
                row[f"{col}_x_hooks"] = summarize(samples, sysname, floor, "ratio")
                row[f"{col}_minus_floor_us"] = summarize(samples, sysname, floor, "diff")
            else:
                row["hooks_x_plain"] = summarize(samples, sysname, ref_plain, "ratio")
        rows.append(row)
    derived = {}
    if case["name"] == "invokes":
        for col, one, many in (("hooks", "hooks", "hooks8"), ("asyncinterp", "asyncinterp", "asyncinterp8"),
                               ("nnsight", "nnsight", "nnsight8")):
            if many in samples:
                per = [(p - q) / (N_INVOKES - 1) for p, q in zip(samples[many], samples[one])]
                derived[f"{col}_per_extra_invoke_us"] = _median_ci(per)
    if case["name"] == "empty":
        derived["asyncinterp_fixed_cost_us"] = summarize(samples, "asyncinterp", "plain", "diff")
        if "nnsight" in samples:
            derived["nnsight_fixed_cost_us"] = summarize(samples, "nnsight", "plain", "diff")
    return {"rows": rows, "derived": derived}


def bench_model(spec, args, rng, log):
    with_nn = nnsight is not None and not args.no_nnsight
    cases, extra = make_cases(spec, with_nn)
    heavy = spec["name"] == "gpt2-small"   # ~0.1 s per forward: a few rounds show the ratios
    if heavy:
        budget, min_rounds, warm = (0.0, 1, 0) if args.quick else (1.5 * args.budget, 7, 1)
    else:
        budget, min_rounds, warm = args.budget, (8 if args.quick else 20), 30
    out = {"model": spec["name"], "desc": spec["desc"], "cases": {}}
    for case in cases:
        check_case(case, extra)
    log(f"  {spec['name']}: correctness checks passed ({len(cases)} cases)")
    for case in cases:
        clocks, rounds, inner = time_case(case, budget, min_rounds, 20000, rng, log, warm)
        gc.collect()
        entry = {"rounds": rounds, "inner": inner}
        for clock, samples in clocks.items():
            entry[clock] = summarize_case(case, samples)
        out["cases"][case["name"]] = entry
    return out


def identity_cases(ai, module=None, xs=None):
    """The warm cases on ``nn.Identity`` for the asyncinterp package ``ai``: ``id-plain``, ``id-empty``
    (an empty run), ``id-b8`` (one invoke of batch 8 reading the output) and ``id-inv8`` (8 invokes of batch 1).

    ``xs``: the 8 inputs of batch 1 (random by default); the single-input cases use ``xs[0]``.
    """
    module = nn.Identity() if module is None else module
    xs = [torch.randn(1, 64) for _ in range(N_INVOKES)] if xs is None else xs
    x, x8 = xs[0], torch.cat(xs)
    model = ai.wrap(module)

    async def empty(m):
        return None

    async def read(m):
        return await m.output

    def inv8():
        with model.trace() as tr:
            invs = [tr.invoke(xi, read) for xi in xs]
        return [inv.result for inv in invs]

    return {"id-plain": lambda: module(x), "id-empty": lambda: model.trace(x, empty),
            "id-b8": lambda: model.trace(x8, read), "id-inv8": inv8}


def bench_hot(args, rng, log):
    """Warm-cache costs: the same calls back to back on ``nn.Identity`` (no model work to evict caches).

    Separates each library's own Python time from the cache effects that a real
    forward adds around it (see the README).
    """
    with_nn = nnsight is not None and not args.no_nnsight
    xs = [torch.randn(1, 64) for _ in range(N_INVOKES)]
    x, x8 = xs[0], torch.cat(xs)
    ours = identity_cases(ai, nn.Identity(), xs)
    systems = {"plain": ours["id-plain"], "asyncinterp": ours["id-empty"],
               "asyncinterp_b8": ours["id-b8"], "asyncinterp8": ours["id-inv8"]}
    if with_nn:
        nnmodel = BatchedNNsight(nn.Identity())

        def nn_empty():
            with nnmodel.trace(x):
                pass

        def nn_b8():
            with nnmodel.trace(x8):
                h = nnmodel.output.save()
            return h

        def nn_inv8():
            with nnmodel.trace() as tracer:
                hs = nnsight.save([])
                for xi in xs:
                    with tracer.invoke(xi):
                        hs.append(nnmodel.output)
            return hs

        systems.update({"nnsight": nn_empty, "nnsight_b8": nn_b8, "nnsight8": nn_inv8})
    case = {"name": "hot", "systems": systems}
    budget = args.budget * (0.5 if args.quick else 1.0)
    clocks, rounds, inner = time_case(case, budget, 8 if args.quick else 20, 20000, rng, log)
    out = {"rounds": rounds, "inner": inner}
    for clock, smp in clocks.items():
        d = {"median_us": {n: _median(v) for n, v in smp.items()},
             "asyncinterp_fixed_cost_us": summarize(smp, "asyncinterp", "plain", "diff")}
        d["asyncinterp_per_extra_invoke_us"] = _median_ci(
            [(p - q) / (N_INVOKES - 1) for p, q in zip(smp["asyncinterp8"], smp["asyncinterp_b8"])])
        if with_nn:
            d["nnsight_fixed_cost_us"] = summarize(smp, "nnsight", "plain", "diff")
            d["nnsight_per_extra_invoke_us"] = _median_ci(
                [(p - q) / (N_INVOKES - 1) for p, q in zip(smp["nnsight8"], smp["nnsight_b8"])])
        out[clock] = d
    return out


# ------------------------------------------------------------------ reporting
def _fmt_us(v):
    if v is None:
        return "—"
    return f"{v:,.1f}" if v < 10_000 else f"{v:,.0f}"


def _fmt_x(stat):
    return "—" if stat is None else f"{stat[0]:.3f}"


def _fmt_ci(stat, unit=" µs", fmt="+.1f"):
    m, lo, hi = stat
    if math.isinf(lo):
        return f"{m:{fmt}}{unit} (too few rounds for a CI)"
    return f"{m:{fmt}}{unit} (95% CI {lo:{fmt}} … {hi:{fmt}})"


def table(results, nn_on, clock):
    head = ["model", "case", "plain µs", "hooks µs", "asyncinterp µs", "ai ×plain", "ai ×hooks"]
    if nn_on:
        head += ["nnsight µs", "nn ×plain", "nn ×hooks"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|"]
    for res in results:
        for cname in ("empty", "read1", "read_all", "edit", "invokes", "outside"):
            case = res["cases"].get(cname)
            if case is None:
                continue
            for row in case[clock]["rows"]:
                hooks = _fmt_us(row["hooks_us"]) if row["hooks_us"] is not None else "(= plain)"
                cells = [res["model"], row["case"], _fmt_us(row["plain_us"]), hooks,
                         _fmt_us(row.get("asyncinterp_us")), _fmt_x(row.get("asyncinterp_x_plain")),
                         _fmt_x(row.get("asyncinterp_x_hooks"))]
                if nn_on:
                    cells += [_fmt_us(row.get("nnsight_us")), _fmt_x(row.get("nnsight_x_plain")),
                              _fmt_x(row.get("nnsight_x_hooks"))]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _verdict(stat, target):
    """PASS if the whole 95% CI is within the target, MISS if all of it is beyond, else UNRESOLVED."""
    _, lo, hi = stat
    if math.isinf(lo):
        return "UNRESOLVED (too few rounds)"
    if hi <= target:
        return "PASS"
    if lo > target:
        return "MISS"
    return "UNRESOLVED (CI spans the target)"


def targets(results, clock, hot=None):
    lines = []
    by = {r["model"]: r for r in results}
    verdicts = {}
    lines.append("Verdicts: PASS = the whole 95% CI meets the target, MISS = none of it does, UNRESOLVED = noise.")
    lines.append(f"Fixed cost per run (empty run minus plain forward; target <= {TARGETS['fixed_cost_us']:.0f} µs):")
    for r in results:
        d = r["cases"]["empty"][clock]["derived"]
        fc = d["asyncinterp_fixed_cost_us"]
        ok = _verdict(fc, TARGETS["fixed_cost_us"])
        verdicts[f"fixed_cost[{r['model']}]"] = ok
        nn = f"; nnsight {_fmt_ci(d['nnsight_fixed_cost_us'])}" if "nnsight_fixed_cost_us" in d else ""
        lines.append(f"  {r['model']:<11} asyncinterp {_fmt_ci(fc)}  {ok}{nn}")
    lines.append(f"Extra cost per invoke ((8 invokes - 1 invoke of batch 8) / 7; target <= "
                 f"{TARGETS['extra_invoke_us']:.0f} µs):")
    for r in results:
        d = r["cases"]["invokes"][clock]["derived"]
        a = d["asyncinterp_per_extra_invoke_us"]
        ok = _verdict(a, TARGETS["extra_invoke_us"])
        verdicts[f"extra_invoke[{r['model']}]"] = ok
        parts = [f"asyncinterp {_fmt_ci(a)}  {ok}", f"hooks {_fmt_ci(d['hooks_per_extra_invoke_us'])}"]
        if "nnsight_per_extra_invoke_us" in d:
            parts.append(f"nnsight {_fmt_ci(d['nnsight_per_extra_invoke_us'])}")
        lines.append(f"  {r['model']:<11} " + "; ".join(parts))
    if "gpt2-tiny" in by:
        row = by["gpt2-tiny"]["cases"]["read_all"][clock]["rows"][0]
        x = row["asyncinterp_x_hooks"]
        ok = _verdict(x, TARGETS["every_block_vs_hooks"])
        verdicts["every_block_vs_hooks[gpt2-tiny]"] = ok
        nn = f"; nnsight {row['nnsight_x_hooks'][0]:.3f}x" if "nnsight_x_hooks" in row else ""
        lines.append(f"Every-block read on gpt2-tiny vs hand-written hooks (target <= {TARGETS['every_block_vs_hooks']}x): "
                     f"asyncinterp {_fmt_ci(x, 'x', '.3f')}  {ok}{nn}")
    if hot is not None:
        h = hot[clock]
        nn = ""
        if "nnsight_fixed_cost_us" in h:
            nn = (f"; nnsight {_fmt_ci(h['nnsight_fixed_cost_us'])}, per extra invoke "
                  f"{_fmt_ci(h['nnsight_per_extra_invoke_us'])}")
        lines.append("Warm-cache costs (nn.Identity, back-to-back calls; the libraries' own Python time):")
        lines.append(f"  asyncinterp fixed cost {_fmt_ci(h['asyncinterp_fixed_cost_us'])}, per extra invoke "
                     f"{_fmt_ci(h['asyncinterp_per_extra_invoke_us'])}{nn}")
    lines.append("Wrapped model called outside a run (target for module(x): no measurable cost, i.e. the 95% CI of "
                 "the paired difference includes 0 or the ratio is <= 1.01):")
    for r in results:
        rows = r["cases"]["outside"][clock]["rows"]
        for row, what in zip(rows, ("module(x) after wrap", "wrapper(x)")):
            d = row["asyncinterp_minus_floor_us"]
            x = row["asyncinterp_x_plain"]
            if what == "wrapper(x)":  # the envoy's own call: reported, not judged
                verdict = "(info)"
            else:
                if math.isinf(d[1]):
                    ok = "UNRESOLVED (too few rounds)"
                else:
                    ok = "PASS" if (d[1] <= 0 <= d[2]) or x[0] <= 1.01 else "MISS"
                verdicts[f"outside[{r['model']}]"] = ok
                verdict = ok
            nn = ""
            if "nnsight_minus_floor_us" in row:
                nn = f"; nnsight {_fmt_ci(row['nnsight_minus_floor_us'])} = {row['nnsight_x_plain'][0]:.3f}x"
            lines.append(f"  {r['model']:<11} {what:<21} asyncinterp {_fmt_ci(d)} = {x[0]:.3f}x  {verdict}{nn}")
    return "\n".join(lines), verdicts


def environment(args):
    try:
        commit = subprocess.run(["git", "-C", str(HERE.parent), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(HERE.parent), "status", "--porcelain", "--", "src"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        if dirty:
            commit += " + uncommitted src changes"
    except Exception:  # noqa: BLE001
        commit = "?"
    cpu = platform.processor() or ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import transformers
        tv = transformers.__version__
    except Exception:  # noqa: BLE001
        tv = None
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "mode": "quick" if args.quick else "full",
        "python": platform.python_version(), "torch": torch.__version__, "transformers": tv,
        "asyncinterp": ai.__version__, "asyncinterp_commit": commit, "nnsight": NNSIGHT_STATUS,
        "cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "pinned_cpu": args.pin,
        "loadavg_at_start": load,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run (~30 s)")
    p.add_argument("--out", metavar="FILE",
                   help="write FILE.json and FILE.md (a bare name goes into benchmarks/results/)")
    p.add_argument("--models", default=None,
                   help=f"comma list of {', '.join(BUILDERS)} (default: all; --quick: mlp12,gpt2-tiny)")
    p.add_argument("--no-nnsight", action="store_true", help="skip nnsight even if installed")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds of timing per case (default 5.5, --quick 0.8; doubled for gpt2-small)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="clock of the table: wall (perf_counter_ns, default) or cpu (thread_time_ns, robust "
                        "when other processes compete for the cores); both are recorded in the JSON")
    p.add_argument("--no-hot", action="store_true", help="skip the warm-cache nn.Identity measurements")
    p.add_argument("--pin", type=int, metavar="CPU", default=None,
                   help="pin the process to one CPU (fewer migrations on a busy machine)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.budget is None:
        args.budget = 0.8 if args.quick else 5.5
    if args.models is None:
        args.models = "mlp12,gpt2-tiny" if args.quick else ",".join(BUILDERS)

    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    rng = random.Random(args.seed)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    env = environment(args)
    log(f"asyncinterp overhead benchmark ({env['mode']}); torch {env['torch']}, {env['nnsight']}, "
        f"load avg {env['loadavg_at_start']}")
    t_start = time.perf_counter()
    results = []
    hot = None
    if not args.no_hot:
        log("  hot loop (nn.Identity)")
        hot = bench_hot(args, rng, log)
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        try:
            spec = BUILDERS[name]()
        except ImportError as exc:
            log(f"  {name}: skipped ({exc})")
            continue
        gc.collect()
        gc.freeze()
        results.append(bench_model(spec, args, rng, log))
        del spec
        gc.unfreeze()
        gc.collect()
    env["seconds"] = round(time.perf_counter() - t_start, 1)
    try:
        env["loadavg_at_end"] = os.getloadavg()[0]
    except OSError:
        env["loadavg_at_end"] = None
    env["clock"] = args.clock
    other = "cpu" if args.clock == "wall" else "wall"

    nn_on = any("nnsight_us" in row for r in results for c in r["cases"].values() for row in c["wall"]["rows"])
    tab = table(results, nn_on, args.clock)
    tgt, verdicts = targets(results, args.clock, hot)
    tgt_other, verdicts_other = targets(results, other, hot)
    models = "\n".join(f"- **{r['model']}**: {r['desc']}" for r in results)
    clock_name = {"wall": "wall clock, time.perf_counter_ns", "cpu": "thread CPU time, time.thread_time_ns"}
    notes = (
        f"Clock: {clock_name[args.clock]}. Times are medians (µs per call) over interleaved rounds; ×plain/×hooks are medians of the per-round "
        "paired ratios. `hooks` is the floor: hand-written `register_forward_hook`s doing the same reads/edits "
        "(installed and removed around each call). For the empty-run and outside-a-run rows the floor is the "
        "plain forward. Invoke rows: `plain` is one forward of batch 8; `8 invokes` row for hooks = concatenate "
        "the 8 inputs, one hook, slice 8 row views. nnsight runs on its own deep copy of each model (it "
        "instruments every module)."
        + ("" if nn_on else f" {NNSIGHT_STATUS}.")
    )
    header = (f"asyncinterp {env['asyncinterp']} ({env['asyncinterp_commit']}), torch {env['torch']}, "
              f"transformers {env['transformers']}, {env['nnsight']}, Python {env['python']}, {env['cpu']}, "
              f"{env['cores']} cores, torch threads {env['torch_threads']}, mode {env['mode']}, "
              f"{env['seconds']} s, load avg {env['loadavg_at_start']:.2f} at start / {env['loadavg_at_end']:.2f} at end, "
              f"{env['date']}")
    md = (f"{header}\n\n{models}\n\n{tab}\n\n{notes}\n\nTargets ({clock_name[args.clock]}):\n\n```\n{tgt}\n```\n\n"
          f"Same targets on the other clock ({clock_name[other]}):\n\n```\n{tgt_other}\n```\n")
    print(md)
    if args.out:
        base = Path(args.out)
        if base.parent == Path("."):
            base = RESULTS / base.name
        if base.suffix in (".md", ".json"):
            base = base.with_suffix("")
        base.parent.mkdir(parents=True, exist_ok=True)
        base.with_suffix(".md").write_text(md)
        payload = {"env": env, "targets": TARGETS, "verdicts": {args.clock: verdicts, other: verdicts_other},
                   "results": results, "hot": hot}
        base.with_suffix(".json").write_text(json.dumps(payload, indent=1, default=str))
        log(f"wrote {base.with_suffix('.md')} and {base.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
