"""Serving throughput: coalesced requests vs one forward per request vs a plain batched forward.

    python benchmarks/serving.py                         # gpt2-small and smollm2, in process (~3 min on 2 cores)
    python benchmarks/serving.py --http                  # also through uvicorn + httpx (server in a subprocess)
    python benchmarks/serving.py --http --process        # and with the model in supervised worker processes
    python benchmarks/serving.py --models gpt2-small --clients 1,8,32 --rounds 3 --out latest

N concurrent clients (N = 1, 8, 32) each send ``--per-client`` requests one
after another (closed loop). Every request carries its own intervention: read
the output of a middle block at the last position and return it (a clone).

modes (same prompts, same model, grad off):

* ``coalesced``   -- ``ai.serve.Batcher(model, max_batch=32, max_wait_ms=2)``: concurrent
                     requests become invokes of shared forward passes;
* ``one-by-one``  -- ``Batcher(model, max_batch=1)``: one forward per request, same code path;
* ``plain-batch`` -- the N prompts as one padded batch through the bare transformers model,
                     no interventions, no asyncinterp (the ceiling for coalescing);
* ``plain-single``-- the bare model on one prompt at a time, no interventions (the ceiling
                     for one-by-one);
* with ``--http``: ``coalesced-http`` / ``one-by-one-http`` -- the same through
  ``asyncinterp serve`` (uvicorn in a subprocess, ``--max-batch 32`` / ``1``) and
  ``ai.serve.AsyncClient``, with the registered ``read`` intervention;
* with ``--process`` too: ``coalesced-http-process`` -- the coalesced server with
  ``--isolation process`` (the model runs in a supervised worker process; requests and
  results cross a pipe as msgpack): the cost of the process boundary.

Rounds interleave the modes in a shuffled order (fair under background load);
req/s is the median over rounds; latency percentiles pool every request of
every round. Ratios at 32 clients are printed at the end (targets from the
issue: coalesced >= 5x one-by-one, >= 0.8x plain-batch).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

import asyncinterp as ai  # noqa: E402
from asyncinterp.serve import Batcher  # noqa: E402

MODELS = {
    # name: (loader, path of the block whose output each request reads)
    "gpt2-small": ("gpt2-small", "transformer.h.6"),
    "smollm2": ("smollm2", "model.layers.15"),
}


def prompts(n: int) -> list:
    subjects = ["the quick brown fox", "a small red boat", "the old stone bridge", "my neighbour's cat",
                "the evening train", "a quiet library", "the tall lighthouse", "our garden hose"]
    return [f"Request {i}: {subjects[i % len(subjects)]} jumps over the lazy dog" for i in range(n)]


def load(name):
    from asyncinterp.serve.cli import load_model
    return load_model(MODELS[name][0])


def envoy_at(m, path):
    e = m
    for part in path.split("."):
        e = e.child(part)
    return e


def make_read(path):
    async def read(m):
        h = await envoy_at(m, path).output
        h = h[0] if isinstance(h, tuple) else h
        return h[:, -1].clone()
    return read


def pct(values, q):
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))
    return s[k]


# --------------------------------------------------------------------------- modes
async def run_batcher(batcher, fn, ps, clients, per_client):
    lat = []

    async def client(i):
        for j in range(per_client):
            p = ps[(i * per_client + j) % len(ps)]
            t = time.perf_counter()
            await batcher.trace(p, fn)
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*[client(i) for i in range(clients)])
    return clients * per_client / (time.perf_counter() - t0), lat


def run_plain_batch(lm, ps, clients, per_client):
    tok, module = lm.tokenizer, lm.module
    enc = tok(ps[:clients], return_tensors="pt", padding=True)
    pos = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    lat = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for _ in range(per_client):
            t = time.perf_counter()
            module(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], position_ids=pos)
            lat.extend([time.perf_counter() - t] * clients)
    return clients * per_client / (time.perf_counter() - t0), lat


def run_plain_single(lm, ps, clients, per_client):
    tok, module = lm.tokenizer, lm.module
    encs = [tok([p], return_tensors="pt") for p in ps[:clients]]
    lat = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for _ in range(per_client):
            for enc in encs:
                t = time.perf_counter()
                module(**enc)
                lat.append(time.perf_counter() - t)
    # closed-loop clients served one at a time: a request waits for the ones ahead of it
    n = clients * per_client
    return n / (time.perf_counter() - t0), [x * clients for x in lat]


# --------------------------------------------------------------------------- http
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    def __init__(self, model, max_batch, threads=None, isolation="thread"):
        import httpx
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "asyncinterp.serve.cli", MODELS[model][0], "--port", str(self.port),
               "--max-batch", str(max_batch), "--max-wait-ms", "2" if max_batch > 1 else "0",
               "--max-queue", "1024", "--log-level", "warning", "--timeout", "300", "--isolation", isolation]
        if threads:
            cmd += ["--threads", str(threads)]
        env = dict(os.environ, PYTHONPATH=str(HERE.parent / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
        # the server's log goes to a file (a pipe nobody reads would block the server once full)
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"serving-{model}-{isolation}-", suffix=".log",
                                               delete=False)
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=self.log)
        print(f"   server (max_batch {max_batch}, isolation {isolation}) log: {self.log.name}", flush=True)
        deadline = time.monotonic() + 180
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {Path(self.log.name).read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/v1/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError("server did not start")
            time.sleep(0.25)

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


async def run_http(url, path, ps, clients, per_client):
    from asyncinterp.serve import AsyncClient
    lat = []
    async with AsyncClient(url, timeout=300) as c:
        await c.trace(ps[0], "read", module=path)   # connection warm-up

        async def client(i):
            for j in range(per_client):
                p = ps[(i * per_client + j) % len(ps)]
                t = time.perf_counter()
                await c.trace(p, "read", module=path)
                lat.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        await asyncio.gather(*[client(i) for i in range(clients)])
        return clients * per_client / (time.perf_counter() - t0), lat


# --------------------------------------------------------------------------- driver
def bench_model(name, args):
    print(f"\n== {name}: loading", flush=True)
    lm = load(name)
    path = MODELS[name][1]
    read = make_read(path)
    ps = prompts(64)
    coalesced = Batcher(lm, max_batch=32, max_wait_ms=2, max_queue=4096, name="bench-coalesced")
    single = Batcher(lm, max_batch=1, max_wait_ms=0, max_queue=4096, name="bench-single")

    # correctness first: a coalesced request returns what a solo run returns (up to float rounding)
    async def check():
        got = await asyncio.gather(*[coalesced.trace(p, read) for p in ps[:8]])
        for p, g in zip(ps[:8], got):
            with torch.no_grad():
                ref = lm.trace(p, read)
            assert torch.allclose(g, ref, atol=1e-4, rtol=1e-4), (p, (g - ref).abs().max())
    asyncio.run(check())

    servers = {}
    if args.http:
        print("   starting servers", flush=True)
        specs = {"coalesced-http": (32, "thread"), "one-by-one-http": (1, "thread")}
        if args.process:
            specs["coalesced-http-process"] = (32, "process")
        servers = {m: ServerProc(name, batch, args.threads, isolation) for m, (batch, isolation) in specs.items()
                   if args.modes is None or m in args.modes}
    rows = []
    try:
        for n in args.clients:
            per_client = max(1, args.per_client if n > 1 else args.per_client * 4)
            modes = {
                "coalesced": lambda: asyncio.run(run_batcher(coalesced, read, ps, n, per_client)),
                "one-by-one": lambda: asyncio.run(run_batcher(single, read, ps, n, per_client)),
                "plain-batch": lambda: run_plain_batch(lm, ps, n, per_client),
                "plain-single": lambda: run_plain_single(lm, ps, n, per_client),
            }
            for mode, srv in servers.items():
                modes[mode] = (lambda s=srv: asyncio.run(run_http(s.url, path, ps, n, per_client)))
            if args.modes:
                modes = {m: f for m, f in modes.items() if m in args.modes}
            for f in modes.values():   # warm-up at this batch size
                f()
            samples = {m: [] for m in modes}
            lats = {m: [] for m in modes}
            for r in range(args.rounds):
                order = list(modes)
                random.Random(r * 31 + n).shuffle(order)
                for m in order:
                    rps, lat = modes[m]()
                    samples[m].append(rps)
                    lats[m].extend(lat)
            for m in modes:
                row = {"model": name, "clients": n, "mode": m, "requests": n * per_client * args.rounds,
                       "rps": statistics.median(samples[m]), "rps_rounds": samples[m],
                       "p50_ms": 1000 * pct(lats[m], 50), "p99_ms": 1000 * pct(lats[m], 99)}
                rows.append(row)
                print(f"   N={n:>2} {m:<16} {row['rps']:8.1f} req/s   p50 {row['p50_ms']:8.1f} ms   "
                      f"p99 {row['p99_ms']:8.1f} ms   rounds {['%.1f' % x for x in samples[m]]}", flush=True)
    finally:
        coalesced.close()
        single.close()
        for s in servers.values():
            s.close()
    return rows


def table(rows):
    by = {(r["model"], r["clients"], r["mode"]): r for r in rows}
    out = ["| model | clients | mode | req/s | p50 ms | p99 ms | vs one-by-one | vs plain-batch |",
           "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        one = by.get((r["model"], r["clients"], "one-by-one-http" if "-http" in r["mode"] else "one-by-one"))
        plain = by.get((r["model"], r["clients"], "plain-batch"))
        vs1 = f"{r['rps'] / one['rps']:.2f}x" if one else ""
        vsp = f"{r['rps'] / plain['rps']:.2f}x" if plain else ""
        out.append(f"| {r['model']} | {r['clients']} | {r['mode']} | {r['rps']:.1f} | {r['p50_ms']:.1f} | "
                   f"{r['p99_ms']:.1f} | {vs1} | {vsp} |")
    return "\n".join(out)


def summary(rows):
    rows_all = rows
    by = {(r["model"], r["clients"], r["mode"]): r["rps"] for r in rows}
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        n = max(r["clients"] for r in rows if r["model"] == model)
        c, o = by.get((model, n, "coalesced")), by.get((model, n, "one-by-one"))
        pb, ps_ = by.get((model, n, "plain-batch")), by.get((model, n, "plain-single"))
        if None not in (c, o, pb, ps_):
            lines.append(f"- {model}, {n} clients: coalesced / one-by-one = {c / o:.2f}x (target >= 5x); "
                         f"coalesced / plain-batch = {c / pb:.2f}x (target >= 0.8x); "
                         f"plain-batch / plain-single = {pb / ps_:.2f}x (what batching itself buys on this machine)")
        ch, oh = by.get((model, n, "coalesced-http")), by.get((model, n, "one-by-one-http"))
        if ch and oh and pb:
            lines.append(f"- {model}, {n} clients over HTTP: coalesced / one-by-one = {ch / oh:.2f}x; "
                         f"coalesced-http / plain-batch = {ch / pb:.2f}x")
        cp = by.get((model, n, "coalesced-http-process"))
        if cp and ch:
            rounds = {r["mode"]: r["rps_rounds"] for r in rows_all if r["model"] == model and r["clients"] == n}
            paired = sorted(a / b for a, b in zip(rounds["coalesced-http-process"], rounds["coalesced-http"]))
            lines.append(f"- {model}, {n} clients over HTTP: process isolation / in process = {cp / ch:.2f}x "
                         f"(medians; per round, paired: median {statistics.median(paired):.2f}x, "
                         f"{', '.join(f'{x:.2f}' for x in paired)}; target >= 0.9x)")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt2-small,smollm2")
    p.add_argument("--clients", default="1,8,32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--per-client", type=int, default=3, help="requests per client per round (x4 for N=1)")
    p.add_argument("--http", action="store_true", help="also measure through uvicorn + httpx")
    p.add_argument("--process", action="store_true",
                   help="with --http: also a server whose model runs in a supervised worker process")
    p.add_argument("--modes", default=None,
                   help="only these modes (comma separated), e.g. coalesced-http,coalesced-http-process")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads, here and in the --http servers (1 is the most robust on a "
                        "shared machine: a parallel region waits for its slowest thread)")
    p.add_argument("--out", default=None, help="write benchmarks/results/serving-OUT.{md,json}")
    args = p.parse_args(argv)
    args.clients = [int(x) for x in args.clients.split(",")]
    args.modes = args.modes.split(",") if args.modes else None
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    try:
        load_avg = os.getloadavg()
    except OSError:
        load_avg = None
    rows = []
    for name in args.models.split(","):
        rows.extend(bench_model(name, args))
    env = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
           f"{torch.get_num_threads()} threads, load average at start {load_avg}")
    text = (f"# Serving benchmark ({_dt.date.today()})\n\n{env}\n\n{table(rows)}\n\n{summary(rows)}\n")
    print("\n" + text)
    if args.out:
        out = HERE / "results"
        out.mkdir(exist_ok=True)
        (out / f"serving-{args.out}.md").write_text(text)
        (out / f"serving-{args.out}.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
