"""Tensor parallel across Ray nodes: the same TP=2 model with its ranks on two Ray nodes against two local processes.

    python benchmarks/tp_nodes.py                    # starts a local 2-node Ray cluster and the launcher's ranks
    python benchmarks/tp_nodes.py --out tp_nodes     # also write benchmarks/results/tp_nodes.{json,md}

One rank script (``--rank``) loads a Llama (4 layers, width 256, 8 heads, 4
key/value heads, MLP 512, vocab 1024, random weights; 1 x 32 tokens, under
``torch.no_grad``, one thread per rank) at TP=1 and with
``tp_plan="auto"`` at TP=2, and times in rank 0's process:

* ``forward``: the model's forward, no hooks;
* ``intervention``: ``model.trace(ids, fn)`` where ``fn`` reads
  ``self_attn.q_proj.output`` (column-parallel: gathered at TP=2) and the
  layer's output at every layer, and edits layer 1's ``q_proj`` output in
  place (written back into the shards).

The script runs on two placements of the ranks, alternately ``--repeat``
times: ``launcher`` (:mod:`asyncinterp.distributed.launch`, two processes of
this machine) and ``ray`` (:class:`asyncinterp.distributed.ray_ranks.RayRanks`,
two actors on two nodes of a ``ray.cluster_utils.Cluster``, ``STRICT_SPREAD``).
TP=1 is timed in the same processes. The table gives medians over all
rounds (ms per call). The Ray "nodes" here share one machine, so gloo
talks over loopback in both placements: the difference is what Ray's
placement and actor processes cost, not a real network's latency.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from tp_overhead import build, timed_rounds  # noqa: E402 - the same model and the same paired rounds


def rank_main(path, rounds, inner, out):
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import asyncinterp as ai
    from asyncinterp import distributed as tp

    tp.init()
    if tp.rank() == 0 and not os.path.exists(os.path.join(path, "config.json")):
        build(path)
    dist.barrier()
    torch.set_num_threads(1)
    one = ai.LanguageModel(AutoModelForCausalLM.from_pretrained(path).eval())
    two = ai.LanguageModel(AutoModelForCausalLM.from_pretrained(path, tp_plan="auto").eval())
    layers = len(one.module.model.layers)
    ids = torch.randint(0, 1024, (1, 32), generator=torch.Generator().manual_seed(1))

    async def intervene(m):
        out = []
        for i in range(layers):
            layer = m.model.layers[i]
            q = await layer.self_attn.q_proj.output
            if i == 1:
                q[..., :32] *= 0.5
            out.append(q.sum())
            out.append((await layer.output).sum())
        return (await m.lm_head.output)[:, -1].argmax(-1)

    systems = {
        ("TP=1", "forward"): lambda: one.module(ids),
        ("TP=1", "intervention"): lambda: one.trace(ids, intervene),
        ("TP=2", "forward"): lambda: two.module(ids),
        ("TP=2", "intervention"): lambda: two.trace(ids, intervene),
    }
    with torch.no_grad():
        same = bool(torch.equal(one.trace(ids, intervene), two.trace(ids, intervene)))
        diff = float((one.module(ids).logits - two.module(ids).logits).abs().max())
        for fn in systems.values():   # warm-up
            fn()
        times = timed_rounds(systems, rounds, inner)
    if tp.rank() == 0:
        with open(out, "w") as f:
            json.dump({"times": {f"{a} {b}": v for (a, b), v in times.items()}, "same_top": same,
                       "max_logit_diff": diff}, f)


def run_launcher(argv) -> None:
    from asyncinterp.distributed.launch import launch
    job = launch(argv, nproc=2, timeout=1200)
    if not job.ok:
        raise RuntimeError(f"launcher ranks failed:\n{job.output(0)[-4000:]}\n{job.output(1)[-2000:]}")


class RayNodes:
    """A local Ray cluster: a head with no CPUs and two one-CPU nodes (one rank each)."""

    def __enter__(self):
        import ray
        from ray.cluster_utils import Cluster

        from asyncinterp.distributed.ray_ranks import NAMESPACE
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "object_store_memory": 80 << 20, "include_dashboard": False})
        for _ in range(2):
            self.cluster.add_node(num_cpus=1, object_store_memory=80 << 20)
        ray.init(address=self.cluster.address, namespace=NAMESPACE, logging_level=logging.WARNING,
                 log_to_driver=False)
        return self

    def run(self, argv) -> list:
        from asyncinterp.distributed.ray_ranks import RayRanks
        job = RayRanks(nproc=2).run(argv, timeout=1200)
        if not job.ok:
            raise RuntimeError(f"Ray ranks failed:\n{job.output(0)[-4000:]}\n{job.output(1)[-2000:]}")
        return [n["node_id"] for n in job.nodes]

    def __exit__(self, *exc):
        import ray
        ray.shutdown()
        self.cluster.shutdown()


def table(data) -> str:
    med = data["medians"]
    lines = [f"TP=2 Llama (4 layers, width 256, 1 x 32 tokens), ranks as two local processes (launcher) or two "
             f"Ray actors on two Ray nodes (STRICT_SPREAD, one machine); medians of {data['rounds_total']} rounds "
             f"x {data['inner']} calls, ms per call", "",
             "| placement | TP | forward (ms) | with intervention (ms) | intervention x forward |",
             "|---|---|---|---|---|"]
    for placement in ("launcher", "ray"):
        for tpname in ("TP=1", "TP=2"):
            f, i = med[placement][f"{tpname} forward"], med[placement][f"{tpname} intervention"]
            where = ("1 process" if tpname == "TP=1" else
                     "2 processes, 1 machine" if placement == "launcher" else "2 Ray nodes")
            lines.append(f"| {placement} ({where}) | {tpname[-1]} | {f:.2f} | {i:.2f} | {i / f:.2f} |")
    r = med["ray"]["TP=2 intervention"] / med["launcher"]["TP=2 intervention"]
    lines += ["", f"- Ray nodes / launcher, TP=2 with intervention: {r:.2f}",
              f"- Ray nodes / launcher, TP=2 forward: "
              f"{med['ray']['TP=2 forward'] / med['launcher']['TP=2 forward']:.2f}",
              f"- TP=2 equals TP=1 in every run: same top token {data['same_top']}, max logit difference "
              f"{data['max_logit_diff']:.1e}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--inner", type=int, default=5)
    p.add_argument("--repeat", type=int, default=2, help="jobs per placement, alternating (default 2)")
    p.add_argument("--out", default=None, help="write benchmarks/results/OUT.{json,md}")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--path", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank:
        rank_main(args.path, args.rounds, args.inner, args.json)
        return 0
    runs = {"launcher": [], "ray": []}
    with tempfile.TemporaryDirectory() as tmp, RayNodes() as nodes:
        path = os.path.join(tmp, "llama")
        for k in range(args.repeat):
            for placement in ("launcher", "ray"):
                out = os.path.join(tmp, f"{placement}{k}.json")
                job_argv = [__file__, "--rank", "--path", path, "--json", out, "--rounds", str(args.rounds),
                            "--inner", str(args.inner)]
                if placement == "launcher":
                    run_launcher(job_argv)
                else:
                    placed = nodes.run(job_argv)
                    assert len(set(placed)) == 2, placed
                runs[placement].append(json.loads(Path(out).read_text()))
    medians = {pl: {key: statistics.median([t for r in rs for t in r["times"][key]]) for key in rs[0]["times"]}
               for pl, rs in runs.items()}
    data = {"medians": medians, "rounds_total": args.rounds * args.repeat, "inner": args.inner,
            "same_top": all(r["same_top"] for rs in runs.values() for r in rs),
            "max_logit_diff": max(r["max_logit_diff"] for rs in runs.values() for r in rs), "runs": runs}
    text = table(data)
    print(text)
    if args.out:
        (HERE / "results" / f"{args.out}.json").write_text(json.dumps(data, indent=1))
        (HERE / "results" / f"{args.out}.md").write_text(f"# benchmarks/tp_nodes.py\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
