"""How much of a run's fixed cost is cold caches: the same call back to back, and after a gap.

overhead.py and hotpath.py time asyncinterp between real forward passes, where
its fixed cost is several times its warm-cache cost (``nn.Identity`` back to
back). This script separates the two causes a real forward could have: the
forward evicting our code and data, or any few milliseconds of anything else.
Each call is timed (wall clock) right after one of these gaps:

* ``back-to-back``: no gap (warm caches);
* ``python spin``: 7 ms of a pure-Python loop that touches almost no memory;
* ``sleep``: ``time.sleep(0.007)`` (the core may run other work);
* ``memory sweep``: 7 ms of in-place adds over a 64 MB tensor (evicts L1-L3);
* ``gpt2 forward``: one forward of the 12-block x 64-wide GPT-2 at 1 x 32 tokens.

Calls, all on ``nn.Identity`` so that only the library's own work is timed:

* ``plain``: ``module(x)``;
* ``hooks``: one hand-written ``register_forward_hook`` collecting the output,
  installed and removed around ``module(x)`` (the floor of a read);
* ``asyncinterp empty``: ``model.trace(x, fn)`` with an intervention that returns at once;
* ``asyncinterp read``: ``model.trace(x, fn)`` with ``fn`` awaiting ``m.output``;
* ``nnsight empty`` / ``nnsight read`` (only when ``import nnsight`` works).

Usage::

    python benchmarks/coldcache.py            # ~1 min
    python benchmarks/coldcache.py --n 600
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch import nn

import asyncinterp as ai

GAP_MS = 7


def gaps():
    from hotpath import gpt2_12x64
    gpt2, tokens = gpt2_12x64()
    big = torch.zeros(4096, 4096)   # 64 MB
    clock = time.perf_counter_ns

    def spin():
        end = clock() + GAP_MS * 1_000_000
        while clock() < end:
            pass

    def sweep():
        end = clock() + GAP_MS * 1_000_000
        while clock() < end:
            big.add_(1.0)

    return {
        "back-to-back": None,
        "python spin": spin,
        "sleep": lambda: time.sleep(GAP_MS / 1000),
        "memory sweep": sweep,
        "gpt2 forward": lambda: gpt2(tokens),
    }


def calls():
    module = nn.Identity()
    x = torch.randn(1, 64)
    model = ai.wrap(module)

    async def empty(m):
        return None

    async def read(m):
        return await m.output

    def hooks():
        box = []
        h = module.register_forward_hook(lambda mod, args, out: box.append(out))
        try:
            module(x)
        finally:
            h.remove()
        return box

    out = {
        "plain": lambda: module(x),
        "hooks": hooks,
        "asyncinterp empty": lambda: model.trace(x, empty),
        "asyncinterp read": lambda: model.trace(x, read),
    }
    try:
        from nnsight import NNsight
    except Exception:  # noqa: BLE001 - bench-only comparison
        return out
    nn_model = NNsight(nn.Identity())

    def nn_empty():
        with nn_model.trace(x):
            pass

    def nn_read():
        with nn_model.trace(x):
            h = nn_model.output.save()
        return h

    out["nnsight empty"] = nn_empty
    out["nnsight read"] = nn_read
    return out


def measure(n: int):
    """``{(call, gap): median µs}``: each call timed right after each gap, interleaved."""
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    gap_fns, call_fns = gaps(), calls()
    for fn in list(call_fns.values()) + [g for g in gap_fns.values() if g is not None]:
        for _ in range(20):
            fn()
    samples = {(c, g): [] for c in call_fns for g in gap_fns}
    clock = time.perf_counter_ns
    for _ in range(n):
        for g, gap in gap_fns.items():
            for c, call in call_fns.items():
                if gap is None:
                    call()   # the call itself is the warm-up of the timed one
                else:
                    gap()
                t0 = clock()
                call()
                samples[(c, g)].append((clock() - t0) / 1000)
    return {k: statistics.median(v) for k, v in samples.items()}, list(call_fns), list(gap_fns)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=300, help="timed calls per (call, gap) pair")
    args = p.parse_args()
    med, call_names, gap_names = measure(args.n)
    print("median µs per call (wall clock), by what ran just before it")
    print("| call | " + " | ".join(gap_names) + " |")
    print("|---|" + "---:|" * len(gap_names))
    for c in call_names:
        print(f"| {c} | " + " | ".join(f"{med[(c, g)]:,.1f}" for g in gap_names) + " |")
    print()
    print("cost over plain module(x), µs")
    print("| call | " + " | ".join(gap_names) + " |")
    print("|---|" + "---:|" * len(gap_names))
    for c in call_names:
        if c == "plain":
            continue
        print(f"| {c} | " + " | ".join(f"{med[(c, g)] - med[('plain', g)]:+,.1f}" for g in gap_names) + " |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
