"""Hostile load: innocent latency and throughput with spinning and crashing submitted requests.

    python benchmarks/hostile_load.py                          # tiny-gpt2, budgets 0.02/0.05/0.2 s, ~2 min on 2 cores
    python benchmarks/hostile_load.py --model gpt2-small --budgets 0.05 --rounds 3

A real server (``ai.serve.Server`` with ``allow_code=True``, uvicorn on
127.0.0.1 in a thread of this process, ``max_batch=32``, ``max_wait_ms=3``)
gets ``--requests`` requests from ``--concurrency`` closed-loop clients
(``AsyncClient``):

* ``clean``   -- only the innocent requests (a registered intervention reading the last position's logits);
* ``hostile`` -- the same innocent requests mixed (shuffled) with 10% spinning submitted requests
                 (``while True: n += 1`` at the first block's output; each is stopped at its compute
                 budget, ``code_budget``) and 10% crashing submitted requests (``raise ValueError``).

Rounds alternate clean and hostile runs. Reported per budget: the innocent
requests' p50/p99 latency in both runs (pooled over rounds), their ratio (the
issue's target: hostile p50 <= 1.5x clean), throughput (all requests / wall
time), and whether every innocent request succeeded bit-equal to its solo run.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from asyncinterp.serve import AsyncClient, RemoteError, Server  # noqa: E402
from asyncinterp.serve.cli import load_model  # noqa: E402

PROMPTS = ["The cat sat on the", "A dog ran into a", "One two three four five", "Paris is the capital of",
           "I like green tea and", "We went to the big", "She said that he was", "It is a very good",
           "Once upon a time there was a", "The quick brown fox jumps over the"]

SPIN = "async def f(m):\n    h = await m.transformer.h[0].output\n    n = 0\n    while True:\n        n += 1\n"
CRASH = "async def f(m):\n    h = await m.transformer.h[1].output\n    raise ValueError('crashing on purpose')\n"


async def last(m):
    return (await m.lm_head.output)[:, -1].clone()


class Live:
    def __init__(self, server):
        import socket

        import uvicorn
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = server
        self.url = f"http://127.0.0.1:{self.port}"
        self.uv = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                access_log=False, lifespan="on"))
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uv.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    def close(self):
        self.uv.should_exit = True
        self.thread.join(15)
        self.server.batcher.close()


async def run_jobs(url, key, jobs, concurrency):
    sem = asyncio.Semaphore(concurrency)
    async with AsyncClient(url, api_key=key, timeout=120) as c:
        async def one(i, p, kind):
            async with sem:
                t0 = time.perf_counter()
                try:
                    r = await c.trace(p, {"spin": SPIN, "crash": CRASH}.get(kind, "last"))
                except RemoteError as exc:
                    r = exc
                return i, kind, p, r, time.perf_counter() - t0
        t0 = time.perf_counter()
        out = await asyncio.gather(*[one(*j) for j in jobs])
        return out, time.perf_counter() - t0


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-gpt2", help="tiny-gpt2 or gpt2-small (GPT-2 module names)")
    ap.add_argument("--budgets", default="0.02,0.05,0.2", help="code_budget values in seconds")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: results bit-equal to solo runs)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    refs = {p: model.trace(p, last) for p in PROMPTS}
    rng = random.Random(0)
    n_bad = args.requests // 10
    kinds = ["spin"] * n_bad + ["crash"] * n_bad + ["ok"] * (args.requests - 2 * n_bad)
    rng.shuffle(kinds)
    jobs = [(i, rng.choice(PROMPTS), k) for i, k in enumerate(kinds)]
    innocent = [j for j in jobs if j[2] == "ok"]
    print(f"model {args.model}, {args.requests} requests ({n_bad} spinning, {n_bad} crashing), "
          f"concurrency {args.concurrency}, {args.rounds} rounds, torch threads {args.threads}")
    rows = []
    for budget in [float(b) for b in args.budgets.split(",")]:
        key = "bench"
        live = Live(_server(model, key, budget))
        try:
            asyncio.run(run_jobs(live.url, key, innocent[:args.concurrency], args.concurrency))   # warm up
            lat = {"clean": [], "hostile": []}
            rps = {"clean": [], "hostile": []}
            ok = True
            for _ in range(args.rounds):
                for mode, js in (("clean", innocent), ("hostile", jobs)):
                    out, wall = asyncio.run(run_jobs(live.url, key, js, args.concurrency))
                    rps[mode].append(len(js) / wall)
                    for i, kind, p, r, dt in out:
                        if kind == "ok":
                            lat[mode].append(dt)
                            ok &= isinstance(r, torch.Tensor) and torch.equal(r, refs[p])
                        elif kind == "spin":
                            ok &= isinstance(r, RemoteError) and r.status == 504
                        else:
                            ok &= isinstance(r, RemoteError) and r.status == 422
        finally:
            live.close()
        c50, h50 = statistics.median(lat["clean"]), statistics.median(lat["hostile"])
        rows.append((budget, c50, pct(lat["clean"], 0.99), h50, pct(lat["hostile"], 0.99), h50 / c50,
                     statistics.median(rps["clean"]), statistics.median(rps["hostile"]), ok))
    print()
    print("| code_budget | innocent p50 clean | p99 clean | innocent p50 hostile | p99 hostile | p50 ratio | "
          "req/s clean | req/s hostile | all innocent ok |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
    for b, c50, c99, h50, h99, ratio, rc, rh, ok in rows:
        print(f"| {b:g} s | {1000 * c50:.0f} ms | {1000 * c99:.0f} ms | {1000 * h50:.0f} ms | {1000 * h99:.0f} ms "
              f"| {ratio:.2f}x | {rc:.0f} | {rh:.0f} | {'yes' if ok else 'NO'} |")
    return 0 if all(r[-1] for r in rows) else 1


def _server(model, key, budget):
    server = Server(model, api_keys=[key], allow_code=True, exact=True, max_batch=32, max_wait_ms=3, timeout=30,
                    code_budget=budget, max_queue=1024, builtin_interventions=False)
    server.intervention("last")(last)
    return server


if __name__ == "__main__":
    sys.exit(main())
