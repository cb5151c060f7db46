"""Deterministic hot-path counts: CPU instructions (callgrind) and Python opcodes per run.

Wall-clock timings on a shared machine are noisy; instruction counts are not.
Every case is one call that ``benchmarks/overhead.py`` also times:

* ``id-*``: ``nn.Identity`` (the library's own cost, as overhead.py's warm-cache figures);
* ``gpt2-*``: a 12-block x 64-wide GPT-2 (eager attention) at 1 x 32 tokens, random weights.

Usage::

    python benchmarks/hotpath.py --opcodes                 # Python opcodes per call, every case
    python benchmarks/hotpath.py --callgrind               # CPU instructions per call (runs valgrind)
    python benchmarks/hotpath.py --callgrind --cases gpt2-empty,gpt2-plain
    python benchmarks/hotpath.py --time --cases gpt2-plain,gpt2-empty,gpt2-hooks-all,gpt2-read-all
    python benchmarks/hotpath.py --inhook                  # time inside asyncinterp's hooks, per firing

``--callgrind`` runs every case in one ``valgrind --tool=callgrind`` process
(``--instr-atstart=no``: imports run uninstrumented). A tiny C library built on
the fly (``cc``, ``valgrind/callgrind.h``) makes the client requests: each case
is built and warmed up, then only its ``n`` calls are collected and dumped as
their own part; the figure is those instructions divided by ``n``. Derived lines: fixed cost (empty run
minus plain forward), per extra invoke, every-block read / hand-written hooks.
It works on any revision with the public API (``ai.wrap``, ``trace``), so old
and new can be compared with ``PYTHONPATH=<other checkout>/src``.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import subprocess
import sys
import tempfile


def gpt2_12x64():
    """Issue 11's model: a 12-block x 64-wide GPT-2 (eager attention, random weights, eval) and its 1 x 32 input."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(use_cache=False, attn_implementation="eager", n_layer=12, n_embd=64, n_head=4,
                        vocab_size=1024, n_positions=64, bos_token_id=0, eos_token_id=0)
    module = GPT2LMHeadModel(config).eval()
    x = torch.randint(0, 1024, (1, 32), generator=torch.Generator().manual_seed(1))
    return module, x


def build(case):
    import torch

    import asyncinterp as ai

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    if case.startswith("id-"):
        from overhead import identity_cases   # the same warm cases as overhead.py
        return identity_cases(ai)[case]

    return gpt2_cases(ai, *gpt2_12x64())[case]


def gpt2_cases(ai, module, x):
    """The ``gpt2-*`` cases of ``module`` (see :func:`gpt2_12x64`) for the asyncinterp package ``ai``."""
    from overhead import hooks_read   # the same hand-written floor as overhead.py
    blocks = list(module.transformer.h)
    model = ai.wrap(module)

    async def empty(m):
        return None

    async def read_all(m):
        return [await b.output for b in m.transformer.h]

    async def read_layers(m):   # the portable spelling the docs recommend: standard name, index per layer
        return [await m.layers[i].output for i in range(len(blocks))]

    async def read1(m):
        return await m.transformer.h[3].output

    def hooks_all():
        return hooks_read(blocks, lambda: module(x))

    def hooks1():
        return hooks_read([blocks[3]], lambda: module(x))

    return {
        "gpt2-plain": lambda: module(x),
        "gpt2-empty": lambda: model.trace(x, empty),
        "gpt2-hooks1": hooks1,
        "gpt2-read1": lambda: model.trace(x, read1),
        "gpt2-hooks-all": hooks_all,
        "gpt2-read-all": lambda: model.trace(x, read_all),
        "gpt2-read-layers": lambda: model.trace(x, read_layers),
    }


CASES = ["id-plain", "id-empty", "id-b8", "id-inv8",
         "gpt2-plain", "gpt2-empty", "gpt2-hooks1", "gpt2-read1", "gpt2-hooks-all", "gpt2-read-all"]


_CG_SOURCE = r"""
#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void cg_zero(void) { CALLGRIND_ZERO_STATS; }
void cg_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
void cg_dump(const char *what) { CALLGRIND_DUMP_STATS_AT(what); }
"""


def _client(tmp):
    """Callgrind client requests (start instrumenting, zero, toggle collection, dump) via a tiny C library."""
    import ctypes
    src, lib = os.path.join(tmp, "cg.c"), os.path.join(tmp, "cg.so")
    with open(src, "w") as f:
        f.write(_CG_SOURCE)
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", lib, src], check=True)
    return ctypes.CDLL(lib)


def run_cases(cases, n, tmp):
    """Under valgrind: each case warmed up, then ``n`` calls collected and dumped as their own part."""
    cg = _client(tmp)
    import torch  # noqa: F401 - imported before instrumentation starts (fast)
    import transformers  # noqa: F401
    import overhead  # noqa: F401 - the hand-written floor's module (and nnsight, if installed)
    cg.cg_start()
    for case in cases:
        fn = build(case)
        for _ in range(20):
            fn()
        gc.collect()
        k = n or (20 if case.startswith("gpt2") else 200)
        cg.cg_zero()
        cg.cg_toggle()
        for _ in range(k):
            fn()
        cg.cg_toggle()
        cg.cg_dump(f"{case} x{k}".encode())


def count_opcodes(case, n=5):
    """Python opcodes executed per call (every frame, library and model alike)."""
    fn = build(case)
    for _ in range(20):
        fn()
    counts = [0]

    def tracer(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            counts[0] += 1
        return tracer

    sys.settrace(tracer)
    try:
        for _ in range(n):
            fn()
    finally:
        sys.settrace(None)
    return counts[0] / n


def callgrind(cases, n, cache=False):
    """Instructions per call of each case, from one valgrind process (``--instr-atstart=no``).

    ``cache=True`` also simulates the caches and returns the cycle estimate
    ``Ir + 10 * L1 misses + 100 * LL misses`` (kcachegrind's) instead.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cg.out")
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--instr-atstart=no",
               "--collect-atstart=no"] + (["--cache-sim=yes"] if cache else []) + [
               sys.executable, __file__, "--run", ",".join(cases), "--tmp", tmp]
        if n:
            cmd += ["--n", str(n)]
        env = dict(os.environ, PYTHONHASHSEED="0")
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        per = {}
        for name in os.listdir(tmp):
            if not name.startswith("cg.out"):
                continue
            with open(os.path.join(tmp, name)) as f:
                text = f.read()
            trig = re.search(r"^desc: Trigger: Client Request: (\S+) x(\d+)", text, re.M)
            if trig is None:
                continue
            events = re.search(r"^events:\s+(.+)$", text, re.M).group(1).split()
            total = re.search(r"^summary:\s+(.+)$", text, re.M) or re.search(r"^totals:\s+(.+)$", text, re.M)
            counts = dict(zip(events, (int(v) for v in total.group(1).split())))
            value = counts["Ir"]
            if cache:
                value += 10 * (counts["I1mr"] + counts["D1mr"] + counts["D1mw"]) + \
                    100 * (counts["ILmr"] + counts["DLmr"] + counts["DLmw"])
            per[trig.group(1)] = value / int(trig.group(2))
        return per


def paired_samples(fns, rounds, warm=20):
    """Thread-CPU µs of each call of ``fns`` (name -> callable): each warmed up ``warm`` times, then
    ``rounds`` interleaved rounds of one call each, in a fresh shuffled order per round (seeded)."""
    import random
    import time

    for fn in fns.values():
        for _ in range(warm):
            fn()
    samples = {name: [] for name in fns}
    rng = random.Random(0)
    clock = time.thread_time_ns
    for _ in range(rounds):
        order = list(fns)
        rng.shuffle(order)
        for name in order:
            t0 = clock()
            fns[name]()
            samples[name].append((clock() - t0) / 1000)
    return samples


def time_cases(cases, rounds):
    """Thread-CPU time per call: ``rounds`` interleaved rounds (one call of each case per round, shuffled).

    Returns ``{case: median µs}`` and the per-round paired differences/ratios of
    :func:`derived`, each as ``(median, low, high)`` with a ~95% CI (order statistics).
    """
    from overhead import _median_ci
    samples = paired_samples({case: build(case) for case in cases}, rounds)
    per_round = [dict(derived({c: samples[c][i] for c in cases})) for i in range(rounds)]
    stats = {label: _median_ci([r[label] for r in per_round]) for label in per_round[0]}
    return {c: _median_ci(v)[0] for c, v in samples.items()}, stats


def inhook(cases, calls=500):
    """Wall time spent inside asyncinterp's output hooks, per firing (median and mean ns).

    One firing's hook delivers the value, resumes the waiting task until its
    next await and installs the hook of the point it awaits next: the whole
    per-read cost, without the noise of the forward around it. Measured by
    wrapping ``Run.output_hook`` (the documented place to wrap hooks).
    """
    import statistics
    from time import perf_counter_ns

    from asyncinterp.run import Run
    times = []
    plain = Run.output_hook

    def timed_output_hook(self, point):
        hook = plain(self, point)

        def timed(module, args, output):
            t0 = perf_counter_ns()
            try:
                return hook(module, args, output)
            finally:
                times.append(perf_counter_ns() - t0)
        return timed

    Run.output_hook = timed_output_hook
    try:
        out = {}
        for case in cases:
            fn = build(case)
            for _ in range(30):
                fn()
            times.clear()
            for _ in range(calls):
                fn()
            if times:
                out[case] = (statistics.median(times), statistics.mean(times), len(times) / calls)
        return out
    finally:
        Run.output_hook = plain


def derived(per):
    lines = []
    if "id-empty" in per and "id-plain" in per:
        lines.append(("warm fixed cost (id-empty - id-plain)", per["id-empty"] - per["id-plain"]))
    if "id-inv8" in per and "id-b8" in per:
        lines.append(("warm per extra invoke ((id-inv8 - id-b8) / 7)", (per["id-inv8"] - per["id-b8"]) / 7))
    if "gpt2-empty" in per and "gpt2-plain" in per:
        lines.append(("gpt2 fixed cost (gpt2-empty - gpt2-plain)", per["gpt2-empty"] - per["gpt2-plain"]))
    if "gpt2-read1" in per and "gpt2-hooks1" in per:
        lines.append(("gpt2 one read over hooks", per["gpt2-read1"] - per["gpt2-hooks1"]))
    if "gpt2-read-all" in per and "gpt2-hooks-all" in per:
        lines.append(("gpt2 every-block read over hooks", per["gpt2-read-all"] - per["gpt2-hooks-all"]))
        lines.append(("gpt2 every-block read / hooks (ratio)", per["gpt2-read-all"] / per["gpt2-hooks-all"]))
    if "gpt2-read-layers" in per and "gpt2-hooks-all" in per:
        lines.append(("gpt2 every-block read as m.layers[i] / hooks (ratio)",
                      per["gpt2-read-layers"] / per["gpt2-hooks-all"]))
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", help="cases to run under valgrind (what --callgrind executes)")
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, default=None)
    p.add_argument("--opcodes", action="store_true")
    p.add_argument("--callgrind", action="store_true")
    p.add_argument("--time", action="store_true", help="thread-CPU time per call, interleaved paired rounds")
    p.add_argument("--inhook", action="store_true", help="wall time inside asyncinterp's output hooks per firing")
    p.add_argument("--rounds", type=int, default=400, help="with --time: interleaved rounds")
    p.add_argument("--cache", action="store_true",
                   help="with --callgrind: simulate caches, report estimated cycles (Ir + 10 L1m + 100 LLm)")
    p.add_argument("--cases", default=",".join(CASES))
    args = p.parse_args()
    if args.run:
        run_cases(args.run.split(","), args.n, args.tmp)
        return
    cases = [c for c in args.cases.split(",") if c]
    if args.inhook:
        wanted = [c for c in cases if "read" in c] or ["gpt2-read1", "gpt2-read-all"]
        for case, (med, mean, per_call) in inhook(wanted).items():
            print(f"inhook    {case:16} {med:>10,.0f} ns/firing median {mean:>10,.0f} mean  ({per_call:.0f} firings/call)",
                  flush=True)
    if args.time:
        med, stats = time_cases(cases, args.rounds)
        for case in cases:
            print(f"time      {case:16} {med[case]:>14,.1f} µs/call", flush=True)
        for label, (m, lo, hi) in stats.items():
            fmt = ".3f" if "ratio" in label else ",.1f"
            print(f"time      {label:48} {m:>14{fmt}}  (95% CI {lo:{fmt}} … {hi:{fmt}})", flush=True)
    for mode, unit in (("opcodes", "opcodes"), ("callgrind", "instructions")):
        if not getattr(args, mode):
            continue
        if mode == "callgrind":
            per = callgrind(cases, args.n, args.cache)
            unit = "est. cycles" if args.cache else unit
        else:
            per = {case: count_opcodes(case) for case in cases}
        for case in cases:
            print(f"{mode:9} {case:16} {per[case]:>14,.0f} {unit}/call", flush=True)
        for label, v in derived(per):
            print(f"{mode:9} {label:48} {v:>14,.3f}" if "ratio" in label else f"{mode:9} {label:48} {v:>14,.0f}",
                  flush=True)


if __name__ == "__main__":
    main()
