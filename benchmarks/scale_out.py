"""Replicas on Ray Serve: 1 vs 2 replicas of ``asyncinterp serve`` on this machine, one thread each.

    python benchmarks/scale_out.py                       # gpt2-small, 64 streamed requests, 8 at a time
    python benchmarks/scale_out.py --model tiny-gpt2 --requests 200 --concurrency 16 --out latest

Each configuration is the real command line in a subprocess:

* ``single``     -- ``asyncinterp serve MODEL --threads 1`` (uvicorn, no Ray): the baseline;
* ``ray-1``      -- ``asyncinterp serve MODEL --replicas 1`` (a local Ray cluster: proxy + 1 replica);
* ``ray-2``      -- ``asyncinterp serve MODEL --replicas 2`` (proxy + 2 replicas, one CPU each).

Every replica uses one torch thread (Ray gives an actor with ``num_cpus=1``
``OMP_NUM_THREADS=1``; ``--threads 1`` too). The load: ``--requests``
OpenAI streaming completions (``max_tokens`` new tokens, greedy, the
registered ``top_k`` intervention, so every request carries one), at most
``--concurrency`` in flight (closed loop), after a warm-up. Measured:
requests/s over the run, TTFT (the first text chunk) p50/p90, latency p50,
and how many requests each replica answered (``x-asyncinterp-replica``).
On this 2-core machine Ray's proxy, controller and raylet share the cores
with the replicas: the numbers say what one machine gives, not how a
cluster scales.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime as _dt
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
PROMPTS = ["The cat sat on the", "A dog ran into a", "Paris is the capital of", "Once upon a time there was a",
           "One two three four five", "I like green tea and", "We went to the big", "She said that he was"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(config: str, model: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "asyncinterp.serve.scale.replicas", model, "--port", str(port), "--threads", "1",
           "--log-level", "warning", "--max-new-tokens", "64"]
    if config.startswith("ray-"):
        cmd += ["--replicas", config.split("-")[1]]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def wait_ready(proc, url: str, replicas: int, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read()[-3000:]}")
        try:
            seen = {httpx.get(f"{url}/v1/health", timeout=5).headers.get("x-asyncinterp-replica")
                    for _ in range(4 * replicas)}
            if len(seen) >= replicas:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{url} did not come up with {replicas} replica(s) within {timeout:g} s")


def stop(proc) -> None:
    try:
        proc.send_signal(signal.SIGINT)            # the command line takes its Ray cluster down itself
        proc.wait(90)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)        # whatever of its process group is left
    except ProcessLookupError:
        pass
    proc.wait(10)


async def one_request(http, url, model, prompt, max_tokens):
    t0 = time.perf_counter()
    ttft = None
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "asyncinterp": {"intervention": "top_k", "params": {"k": 5}}}
    async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        replica = r.headers.get("x-asyncinterp-replica", "-")
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: {") and '"text"' in line:
                ttft = time.perf_counter() - t0
            if line == "data: [DONE]":
                break
    return ttft, time.perf_counter() - t0, replica


async def load(url, model, requests, concurrency, max_tokens):
    sem = asyncio.Semaphore(concurrency)
    out = []

    async def worker(i, http):
        async with sem:
            out.append(await one_request(http, url, model, PROMPTS[i % len(PROMPTS)], max_tokens))

    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i, http) for i in range(requests)))
        wall = time.perf_counter() - t0
    return out, wall


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure(config, args):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    replicas = int(config.split("-")[1]) if config.startswith("ray-") else 1
    t0 = time.monotonic()
    proc = start(config, args.model, port)
    try:
        wait_ready(proc, url, replicas)
        ready = time.monotonic() - t0
        asyncio.run(load(url, args.model, 2 * args.concurrency, args.concurrency, args.max_tokens))   # warm-up
        results, wall = asyncio.run(load(url, args.model, args.requests, args.concurrency, args.max_tokens))
    finally:
        stop(proc)
    ttfts = [r[0] for r in results]
    lat = [r[1] for r in results]
    shares = sorted(collections.Counter(r[2] for r in results).values(), reverse=True)
    return {"config": config, "replicas": replicas, "ready_s": round(ready, 1), "requests": len(results),
            "req_per_s": round(len(results) / wall, 2), "ttft_p50_ms": round(1000 * pct(ttfts, 0.5), 1),
            "ttft_p90_ms": round(1000 * pct(ttfts, 0.9), 1), "latency_p50_ms": round(1000 * pct(lat, 0.5), 1),
            "latency_mean_ms": round(1000 * statistics.mean(lat), 1), "per_replica": shares}


def table(rows, args) -> str:
    lines = [f"# Scale-out: replicas on Ray Serve ({args.model}, {args.requests} streamed requests, "
             f"{args.concurrency} in flight, {args.max_tokens} new tokens, one thread per replica)", "",
             f"{_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
             f"{os.cpu_count()} CPUs", "",
             "| config | replicas | req/s | TTFT p50 (ms) | TTFT p90 (ms) | latency p50 (ms) | requests per replica "
             "| ready (s) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['replicas']} | {r['req_per_s']} | {r['ttft_p50_ms']} | "
                     f"{r['ttft_p90_ms']} | {r['latency_p50_ms']} | {'/'.join(map(str, r['per_replica']))} | "
                     f"{r['ready_s']} |")
    base = {r["config"]: r for r in rows}
    if "ray-1" in base and "ray-2" in base:
        lines += ["", f"ray-2 / ray-1 throughput: {base['ray-2']['req_per_s'] / base['ray-1']['req_per_s']:.2f}x"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2-small", help="a model name of `asyncinterp serve` (default gpt2-small)")
    p.add_argument("--configs", default="single,ray-1,ray-2")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--out", default=None, help="write benchmarks/results/scale_out-OUT.{md,json}")
    args = p.parse_args(argv)
    rows = []
    for config in args.configs.split(","):
        rows.append(measure(config, args))
        print(json.dumps(rows[-1]), flush=True)
    text = table(rows, args)
    print(text)
    if args.out:
        results = HERE / "results"
        (results / f"scale_out-{args.out}.md").write_text(text)
        (results / f"scale_out-{args.out}.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
