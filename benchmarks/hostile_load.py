"""Hostile load: innocent latency and throughput with spinning and crashing submitted requests.

    python benchmarks/hostile_load.py                          # tiny-gpt2, budgets 0.02/0.05/0.2 s, ~2 min on 2 cores
    python benchmarks/hostile_load.py --model gpt2-small --budgets 0.05 --rounds 3
    python benchmarks/hostile_load.py --isolation process      # supervised workers; bad requests kill them

A real server (``ai.serve.Server`` with ``allow_code=True``, uvicorn on
127.0.0.1 in a thread of this process, ``max_batch=32``, ``max_wait_ms=3``)
gets ``--requests`` requests from ``--concurrency`` closed-loop clients
(``AsyncClient``):

* ``clean``   -- only the innocent requests (a registered intervention reading the last position's logits);
* ``hostile`` -- the same innocent requests mixed (shuffled) with 10% spinning submitted requests
                 (``while True: n += 1`` at the first block's output; each is stopped at its compute
                 budget, ``code_budget``) and 10% crashing submitted requests (``raise ValueError``).
                 With ``--isolation process`` (``Server(isolation=ProcessIsolation(...))``) the 10% bad
                 ones besides the spinners kill their worker process: 5% freeze it (``any(iter(int, 1))``,
                 a C loop holding the GIL: killed after ``--hang-timeout``) and 5% exceed its memory limit
                 (``[0] * 10**9``).

Rounds alternate clean and hostile runs. Reported per budget: the innocent
requests' p50/p99 latency in both runs (pooled over rounds), their ratio (the
issue's target: hostile p50 <= 1.5x clean), throughput (all requests / wall
time), and whether every innocent request succeeded bit-equal to its solo run.

A second table (``steady``) keeps the innocents' load equal in both runs: in
the mixed queue above, bad requests that take long (a freezer holds its
client for about two hang timeouts) leave fewer innocent requests in flight,
which flatters their latency. Here the innocent requests always come from
the same 80% of the clients (26 of 32), one after another; in the hostile
run the other 20% (6 clients) send bad requests back to back until the
innocents are done (thread isolation: spinning and raising; process
isolation: spinning, freezing and exhausting memory, 2:1:1).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
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
FREEZE = "async def f(m):\n    h = await m.transformer.h[0].output\n    return any(iter(int, 1))\n"
HOG = "async def f(m):\n    h = await m.transformer.h[0].output\n    x = [0] * (10 ** 9)\n    return len(x)\n"
SOURCES = {"spin": SPIN, "crash": CRASH, "freeze": FREEZE, "hog": HOG, "ok": "last"}
EXPECTED = {"spin": (504, "timeout"), "crash": (422, "intervention"), "freeze": (504, "hung"),
            "hog": (507, "out_of_memory")}


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
                    r = await c.trace(p, SOURCES[kind])
                except RemoteError as exc:
                    r = exc
                return i, kind, p, r, time.perf_counter() - t0
        t0 = time.perf_counter()
        out = await asyncio.gather(*[one(*j) for j in jobs])
        return out, time.perf_counter() - t0


async def run_steady(url, key, innocent, clients, bad_kinds, bad_clients):
    """Innocent jobs from ``clients`` closed-loop clients; ``bad_clients`` more send bad requests meanwhile."""
    async with AsyncClient(url, api_key=key, timeout=120) as c:
        queue = collections.deque(innocent)
        out, bad_out = [], []
        finished = asyncio.Event()

        async def call(p, kind):
            try:
                return await c.trace(p, SOURCES[kind])
            except RemoteError as exc:
                return exc

        async def innocent_client():
            while queue:
                i, p, kind = queue.popleft()
                t0 = time.perf_counter()
                r = await call(p, kind)
                out.append((i, kind, p, r, time.perf_counter() - t0))

        async def bad_client(k):
            n = k
            while not finished.is_set():
                kind = bad_kinds[n % len(bad_kinds)]
                bad_out.append((kind, await call(PROMPTS[n % len(PROMPTS)], kind)))
                n += bad_clients

        bads = [asyncio.ensure_future(bad_client(k)) for k in range(bad_clients)]
        t0 = time.perf_counter()
        await asyncio.gather(*[innocent_client() for _ in range(clients)])
        wall = time.perf_counter() - t0
        finished.set()
        await asyncio.gather(*bads)
        return out, bad_out, wall


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
    ap.add_argument("--isolation", choices=["thread", "process"], default="thread",
                    help="process: supervised worker processes, and the bad requests freeze or exhaust them")
    ap.add_argument("--hang-timeout", type=float, default=1.0, help="with --isolation process (seconds)")
    ap.add_argument("--tables", default="mixed,steady", help="which measurements: mixed, steady or both")
    args = ap.parse_args(argv)
    tables = args.tables.split(",")
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    refs = {p: model.trace(p, last) for p in PROMPTS}
    rng = random.Random(0)
    n_bad = args.requests // 10
    if args.isolation == "thread":
        worst = ["crash"] * n_bad
    else:
        worst = ["freeze"] * (n_bad // 2) + ["hog"] * (n_bad - n_bad // 2)
    kinds = ["spin"] * n_bad + worst + ["ok"] * (args.requests - 2 * n_bad)
    rng.shuffle(kinds)
    jobs = [(i, rng.choice(PROMPTS), k) for i, k in enumerate(kinds)]
    innocent = [j for j in jobs if j[2] == "ok"]
    bad = "crashing" if args.isolation == "thread" else "freezing or exhausting their worker"
    print(f"model {args.model}, {args.requests} requests ({n_bad} spinning, {n_bad} {bad}), "
          f"concurrency {args.concurrency}, {args.rounds} rounds, torch threads {args.threads}, "
          f"isolation {args.isolation}")
    bad_kinds = ["spin", "crash"] if args.isolation == "thread" else ["spin", "freeze", "spin", "hog"]
    bad_clients = max(1, round(0.2 * args.concurrency))
    rows, steady_rows = [], []
    for budget in [float(b) for b in args.budgets.split(",")]:
        key = "bench"
        live = Live(_server(model, key, budget, args))
        try:
            asyncio.run(run_jobs(live.url, key, innocent[:args.concurrency], args.concurrency))   # warm up
            lat = {"clean": [], "hostile": []}
            rps = {"clean": [], "hostile": []}
            steady = {"clean": [], "hostile": [], "rps_clean": [], "rps_hostile": [], "bad": 0}
            ok = True

            def check(i, kind, p, r):
                if kind == "ok":
                    return isinstance(r, torch.Tensor) and torch.equal(r, refs[p])
                return isinstance(r, RemoteError) and (r.status, r.kind) == EXPECTED[kind]
            for _ in range(args.rounds):
                for mode, js in (("clean", innocent), ("hostile", jobs)):
                    if "mixed" not in tables:
                        break
                    out, wall = asyncio.run(run_jobs(live.url, key, js, args.concurrency))
                    rps[mode].append(len(js) / wall)
                    for i, kind, p, r, dt in out:
                        ok &= check(i, kind, p, r)
                        if kind == "ok":
                            lat[mode].append(dt)
                for mode in ("clean", "hostile"):
                    if "steady" not in tables:
                        break
                    out, bad_out, wall = asyncio.run(run_steady(
                        live.url, key, innocent, args.concurrency - bad_clients, bad_kinds,
                        bad_clients if mode == "hostile" else 0))
                    steady["rps_" + mode].append(len(out) / wall)
                    steady["bad"] += len(bad_out)
                    for i, kind, p, r, dt in out:
                        ok &= check(i, kind, p, r)
                        steady[mode].append(dt)
                    for kind, r in bad_out:
                        ok &= check(None, kind, None, r)
            if args.isolation == "process":
                st = live.server.batcher.stats
                times = live.server.batcher.restart_times()
                print(f"   budget {budget:g}: worker restarts {st['restarts']} ({st.get('hung', 0)} hung, "
                      f"{st.get('out_of_memory', 0)} out of memory), re-runs {st['reruns']}, offenders "
                      f"{st['blamed']}, restart (death to ready) median "
                      f"{1000 * statistics.median(times) if times else float('nan'):.0f} ms")
        finally:
            live.close()
        if "mixed" in tables:
            c50, h50 = statistics.median(lat["clean"]), statistics.median(lat["hostile"])
            rows.append((budget, c50, pct(lat["clean"], 0.99), h50, pct(lat["hostile"], 0.99), h50 / c50,
                         statistics.median(rps["clean"]), statistics.median(rps["hostile"]), ok))
        if "steady" in tables:
            c50, h50 = statistics.median(steady["clean"]), statistics.median(steady["hostile"])
            steady_rows.append((budget, c50, pct(steady["clean"], 0.99), h50, pct(steady["hostile"], 0.99),
                                h50 / c50, statistics.median(steady["rps_clean"]),
                                statistics.median(steady["rps_hostile"]), steady["bad"], ok))
    if rows:
        print("\nmixed queue (the bad requests are 20% of the jobs that 32 clients work through):\n")
        print("| code_budget | innocent p50 clean | p99 clean | innocent p50 hostile | p99 hostile | p50 ratio | "
              "req/s clean | req/s hostile | all innocent ok |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
        for b, c50, c99, h50, h99, ratio, rc, rh, ok in rows:
            print(f"| {b:g} s | {1000 * c50:.0f} ms | {1000 * c99:.0f} ms | {1000 * h50:.0f} ms | "
                  f"{1000 * h99:.0f} ms | {ratio:.2f}x | {rc:.0f} | {rh:.0f} | {'yes' if ok else 'NO'} |")
    if steady_rows:
        print(f"\nsteady innocent load ({args.concurrency - bad_clients} innocent clients in both runs; "
              f"{bad_clients} more send bad requests in the hostile run):\n")
        print("| code_budget | innocent p50 clean | p99 clean | innocent p50 hostile | p99 hostile | p50 ratio | "
              "innocent req/s clean | innocent req/s hostile | bad requests | all ok |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
        for b, c50, c99, h50, h99, ratio, rc, rh, nbad, ok in steady_rows:
            print(f"| {b:g} s | {1000 * c50:.0f} ms | {1000 * c99:.0f} ms | {1000 * h50:.0f} ms | "
                  f"{1000 * h99:.0f} ms | {ratio:.2f}x | {rc:.0f} | {rh:.0f} | {nbad} | {'yes' if ok else 'NO'} |")
    return 0 if all(r[-1] for r in rows + steady_rows) else 1


def _server(model, key, budget, args):
    isolation = "thread"
    if args.isolation == "process":
        from asyncinterp.serve.workers.supervisor import ProcessIsolation
        isolation = ProcessIsolation(hang_timeout=args.hang_timeout, memory_limit=1 << 30)
    server = Server(model, api_keys=[key], allow_code=True, exact=True, max_batch=32, max_wait_ms=3, timeout=30,
                    code_budget=budget, max_queue=1024, builtin_interventions=False, isolation=isolation)
    server.intervention("last")(last)
    if args.isolation == "process":
        server.batcher.start()
    return server


if __name__ == "__main__":
    sys.exit(main())
