"""Tensor parallel: what an every-layer read costs under TP=2 against TP=1 and against hand-written gathers.

    python benchmarks/tp_overhead.py                 # starts its own 2 ranks (gloo, CPU) with the launcher
    python benchmarks/tp_overhead.py --out tp        # also write benchmarks/results/tp.{json,md}

A Llama (4 layers, width 256, 8 heads, 4 key/value heads, MLP 512, vocab
1024, 1 x 32 tokens, random weights) is loaded at TP=1 and with
``tp_plan="auto"`` at TP=2, under ``torch.no_grad``. The every-layer read takes, at every layer, the
decoder layer's output (replicated: no gather) and ``self_attn.q_proj.output``
(column-parallel: gathered at TP=2). Systems, all in rank 0's process (rank 1
runs the same calls so the collectives pair up):

* ``plain``: the model's forward, no hooks;
* ``hooks``: hand-written ``register_forward_hook`` s doing the same reads
  (at TP=2 each q_proj hook does the ``all_gather`` + ``cat`` by hand): the floor;
* ``asyncinterp``: ``model.trace(ids, fn)`` with ``await`` on the same points.

Each round runs every system of both TPs ``--inner`` times in an order
shuffled with a seed both ranks share; the table gives medians over rounds
(ms per call) and ratios to the plain forward of the same TP.
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
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build(path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)


def timed_rounds(systems, rounds, inner) -> dict:
    """``{key: [ms per call, one per round]}``: each round runs every system ``inner`` times, in an order shuffled
    the same way on every rank (a seeded generator), so the ranks' collectives pair up."""
    times = {k: [] for k in systems}
    order = list(systems)
    rng = random.Random(7)
    for _ in range(rounds):
        rng.shuffle(order)
        for key in order:
            t0 = time.perf_counter()
            for _ in range(inner):
                systems[key]()
            times[key].append((time.perf_counter() - t0) / inner * 1e3)
    return times


def rank_main(path, rounds, inner, out):
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import asyncinterp as ai
    from asyncinterp import distributed as tp

    tp.init()
    if tp.rank() == 0:
        build(path)
    dist.barrier()
    torch.set_num_threads(1)
    one = ai.LanguageModel(AutoModelForCausalLM.from_pretrained(path).eval())
    two = ai.LanguageModel(AutoModelForCausalLM.from_pretrained(path, tp_plan="auto").eval())
    group = two.module.model.layers[0].self_attn.q_proj.weight.device_mesh.get_group()
    layers = len(one.module.model.layers)
    ids = torch.randint(0, 1024, (1, 32), generator=torch.Generator().manual_seed(1))

    async def every_layer(m):
        out = []
        for i in range(layers):
            layer = m.model.layers[i]
            out.append(await layer.self_attn.q_proj.output)
            out.append(await layer.output)
        return out

    def hooks(model, gather):
        seen = []

        def read(mod, args, output):
            seen.append(output)

        def read_gathered(mod, args, output):
            parts = [torch.empty_like(output) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, output.contiguous(), group=group)
            seen.append(torch.cat(parts, dim=-1))
        handles = []
        for layer in model.model.layers:
            handles.append(layer.self_attn.q_proj.register_forward_hook(read_gathered if gather else read))
            handles.append(layer.register_forward_hook(read))
        try:
            model(ids)
        finally:
            for h in handles:
                h.remove()
        return seen

    systems = {
        ("TP=1", "plain"): lambda: one.module(ids),
        ("TP=1", "hooks"): lambda: hooks(one.module, False),
        ("TP=1", "asyncinterp"): lambda: one.trace(ids, every_layer),
        ("TP=2", "plain"): lambda: two.module(ids),
        ("TP=2", "hooks"): lambda: hooks(two.module, True),
        ("TP=2", "asyncinterp"): lambda: two.trace(ids, every_layer),
    }
    with torch.no_grad():
        a, b, c = hooks(one.module, False), hooks(two.module, True), two.trace(ids, every_layer)
        assert all(x.shape == y.shape == z.shape and torch.allclose(x, z, atol=1e-5) and torch.allclose(y, z)
                   for x, y, z in zip(a, b, c)), "the systems read different values"
        for fn in systems.values():   # warm-up
            fn()
        times = timed_rounds(systems, rounds, inner)
    if tp.rank() == 0:
        med = {f"{k[0]} {k[1]}": statistics.median(v) for k, v in times.items()}
        rows = []
        for tpname in ("TP=1", "TP=2"):
            plain = med[f"{tpname} plain"]
            for s in ("plain", "hooks", "asyncinterp"):
                rows.append((tpname, s, med[f"{tpname} {s}"], med[f"{tpname} {s}"] / plain))
        extra = {
            "asyncinterp / hooks at TP=2": med["TP=2 asyncinterp"] / med["TP=2 hooks"],
            "asyncinterp / hooks at TP=1": med["TP=1 asyncinterp"] / med["TP=1 hooks"],
            "TP=2 asyncinterp / TP=1 asyncinterp": med["TP=2 asyncinterp"] / med["TP=1 asyncinterp"],
        }
        with open(out, "w") as f:
            json.dump({"rows": rows, "ratios": extra, "rounds": rounds, "inner": inner, "layers": layers}, f)


def table(data) -> str:
    lines = [f"every-layer read (q_proj.output + layer output at each of {data['layers']} layers), "
             f"medians of {data['rounds']} rounds x {data['inner']} calls, ms per call", "",
             "| TP | system | ms | x plain (same TP) |", "|---|---|---|---|"]
    for tpname, system, ms, ratio in data["rows"]:
        lines.append(f"| {tpname} | {system} | {ms:.2f} | {ratio:.2f} |")
    lines.append("")
    for k, v in data["ratios"].items():
        lines.append(f"- {k}: {v:.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--inner", type=int, default=5)
    p.add_argument("--out", default=None, help="write benchmarks/results/OUT.{json,md}")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--path", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank:
        rank_main(args.path, args.rounds, args.inner, args.json)
        return 0
    from asyncinterp.distributed.launch import launch
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        job = launch([__file__, "--rank", "--path", os.path.join(tmp, "llama"), "--json", out,
                      "--rounds", str(args.rounds), "--inner", str(args.inner)], nproc=2, timeout=1200)
        if not job.ok:
            print(job.output(0)[-4000:], job.output(1)[-2000:], file=sys.stderr)
            return job.returncode or 1
        data = json.loads(Path(out).read_text())
    text = table(data)
    print(text)
    if args.out:
        (HERE / "results" / f"{args.out}.json").write_text(json.dumps(data, indent=1))
        (HERE / "results" / f"{args.out}.md").write_text(f"# benchmarks/tp_overhead.py\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
