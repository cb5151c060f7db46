"""Two revisions of asyncinterp in one process: paired, interleaved timings that can tell them apart.

On a shared or virtual machine the same code can time up to 2x apart in two
processes (benchmarks/README.md, "Cold caches"), so running overhead.py once
per revision cannot resolve differences of a few percent. This script loads
``src/asyncinterp`` of another git revision (or a source folder) under the
package name ``asyncinterp_base``, beside the working tree's ``asyncinterp``,
wraps the same module instances with both, and times every case of both
revisions in shuffled rounds (one loop per group of cases, thread-CPU clock). It reports the
per-round paired figures with distribution-free 95% confidence intervals.

Cases (``--cases``, comma-separated groups):

* ``warm``: ``nn.Identity``, back to back: the empty run (fixed cost) and 8
  invokes of batch 1 against 1 invoke of batch 8 (cost per extra invoke);
* ``gpt2``: a 12-block x 64-wide GPT-2 (eager attention) at 1 x 32 tokens, the
  model of issue 11: the empty run (fixed cost after a forward) and reading
  every block's output, against the hand-written hooks of overhead.py (once
  iterating ``m.transformer.h``, once as ``m.layers[i]``, the standard name).

Usage::

    python benchmarks/abtest.py 1dbcdb6                  # that revision vs the working tree
    python benchmarks/abtest.py b5c9ab8 --rounds 3000 --cases warm
    python benchmarks/abtest.py /path/to/other/src/asyncinterp
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

import torch
from torch import nn

import asyncinterp
from hotpath import gpt2_12x64, gpt2_cases, paired_samples
from overhead import _median_ci, identity_cases

BASE = "asyncinterp_base"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_base(where: str, tmp: str):
    """Import ``where`` (a git revision of this repo, or a folder holding the package) as ``asyncinterp_base``."""
    dest = os.path.join(tmp, BASE)
    if os.path.isdir(where):
        src = os.path.join(where, "src", "asyncinterp") if os.path.isdir(os.path.join(where, "src")) else where
        shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        archive = os.path.join(tmp, "base.tar")
        with open(archive, "wb") as f:
            subprocess.run(["git", "-C", REPO, "archive", where, "src/asyncinterp"], check=True, stdout=f)
        with tarfile.open(archive) as t:
            t.extractall(os.path.join(tmp, "tree"), filter="data")
        shutil.move(os.path.join(tmp, "tree", "src", "asyncinterp"), dest)
    sys.path.insert(0, tmp)
    return importlib.import_module(BASE)


_SHARED = {}


def warm_cases(ai, tag):
    if "identity" not in _SHARED:
        _SHARED["identity"] = nn.Identity()
    cases = identity_cases(ai, _SHARED["identity"])
    return {("id-plain" if name == "id-plain" else f"{name}@{tag}"): fn for name, fn in cases.items()}


def gpt2_cases_of(ai, tag):
    if "gpt2" not in _SHARED:
        _SHARED["gpt2"] = gpt2_12x64()
    cases = gpt2_cases(ai, *_SHARED["gpt2"])
    out = {name: cases[name] for name in ("gpt2-plain", "gpt2-hooks-all")}
    out.update({f"{name}@{tag}": cases[name] for name in ("gpt2-empty", "gpt2-read-all", "gpt2-read-layers")})
    return out


def derived(s, tag):
    """Per-round figures of one revision (``s``: case -> this round's µs)."""
    out = {}
    if f"id-empty@{tag}" in s:
        out["warm fixed cost, µs"] = s[f"id-empty@{tag}"] - s["id-plain"]
        out["warm per extra invoke, µs"] = (s[f"id-inv8@{tag}"] - s[f"id-b8@{tag}"]) / 7
    if f"gpt2-empty@{tag}" in s:
        out["gpt2 fixed cost, µs"] = s[f"gpt2-empty@{tag}"] - s["gpt2-plain"]
        out["gpt2 every-block read over hooks, µs"] = s[f"gpt2-read-all@{tag}"] - s["gpt2-hooks-all"]
        out["gpt2 every-block read / hooks"] = s[f"gpt2-read-all@{tag}"] / s["gpt2-hooks-all"]
        out["gpt2 every-block read as m.layers[i] / hooks"] = s[f"gpt2-read-layers@{tag}"] / s["gpt2-hooks-all"]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base", help="git revision of this repo, or a folder with the base package")
    p.add_argument("--rounds", type=int, default=1500)
    p.add_argument("--cases", default="warm,gpt2")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    groups = [g for g in args.cases.split(",") if g]
    with tempfile.TemporaryDirectory() as tmp:
        base = load_base(args.base, tmp)
        rounds = [{} for _ in range(args.rounds)]
        for g in groups:   # each group in its own loop: the warm cases stay warm
            fns = {}
            for ai, tag in ((base, "base"), (asyncinterp, "new")):
                fns.update({"warm": warm_cases, "gpt2": gpt2_cases_of}[g](ai, tag))
            samples = paired_samples(fns, args.rounds, warm=30)
            for i, s in enumerate(rounds):
                s.update((case, values[i]) for case, values in samples.items())
    base_rows = [derived(s, "base") for s in rounds]
    new_rows = [derived(s, "new") for s in rounds]
    print(f"base = {args.base}, new = working tree ({asyncinterp.__file__}); {args.rounds} paired rounds, "
          "thread-CPU clock, medians with 95% CIs")
    print("| metric | base | new | new - base (paired) |")
    print("|---|---:|---:|---:|")
    for label in base_rows[0]:
        fmt = ".3f" if "/" in label else ".1f"
        b = _median_ci([r[label] for r in base_rows])
        n = _median_ci([r[label] for r in new_rows])
        d = _median_ci([nr[label] - br[label] for nr, br in zip(new_rows, base_rows)])
        cell = lambda v: f"{v[0]:{fmt}} ({v[1]:{fmt}}…{v[2]:{fmt}})"
        print(f"| {label} | {cell(b)} | {cell(n)} | {cell(d)} |", flush=True)


if __name__ == "__main__":
    main()
