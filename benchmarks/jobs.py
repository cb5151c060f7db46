"""Kept jobs: how many submissions a server accepts per second, and how fast it answers a job's status,
on the SQLite store (``--state-dir``) and on PostgreSQL (``--database``).

    python benchmarks/jobs.py                         # both stores, ~1-2 min on 2 cores
    python benchmarks/jobs.py --stores sqlite --jobs 500 --concurrency 16

The server is ``asyncinterp serve tiny-gpt2`` in a subprocess (one BLAS thread), with a throwaway
PostgreSQL (``initdb``/``pg_ctl``, tests/pg_helpers.py) for the second store. The client sends ``--jobs``
submissions (``POST /v1/jobs`` with ``wait: false``; one trace invoke with the registered ``top_k``
intervention, its body built once) from ``--concurrency`` concurrent connections and times them: each is
checked as the blocking request would be, its quotas counted, and stored, before its ``202``. The
server's runner runs the jobs meanwhile (the same CPUs), as it would in use. Then ``--status`` status
requests (``GET /v1/jobs/ID``, one connection, random ids of those jobs): median and 95th percentile.
Results go to ``benchmarks/results/jobs.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time

import httpx

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "src"))

from asyncinterp.client import remote as _remote  # noqa: E402
from asyncinterp.client import wire  # noqa: E402
from asyncinterp.client.job_form import dumps_job  # noqa: E402
from jobs_helpers import JobServer  # noqa: E402
from pg_helpers import PostgresServer  # noqa: E402

KEY = "bench-key"


def job_body(url) -> bytes:
    lm = _remote.remote(url, api_key=KEY)
    tr = lm.trace()
    tr.invoke("The Eiffel Tower is in the city of", lm.registered("top_k", k=5))
    return wire.packb({**lm.versions, "job": dumps_job(tr.job), "wait": False})


async def submit_all(url, body, n, concurrency):
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/msgpack"}
    ids, lat = [], []
    queue = asyncio.Queue()
    for _ in range(n):
        queue.put_nowait(None)

    async def worker(http):
        while True:
            try:
                queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            t = time.perf_counter()
            r = await http.post(f"{url}/v1/jobs", content=body, headers=headers)
            lat.append(time.perf_counter() - t)
            if r.status_code != 202:
                raise RuntimeError(f"HTTP {r.status_code}: {r.content[:300]!r}")
            ids.append(r.json()["id"])

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        took = time.perf_counter() - t0
    return ids, took, lat


def status_latency(url, ids, n):
    rng = random.Random(0)
    out = []
    with httpx.Client(timeout=30, headers={"authorization": f"Bearer {KEY}"}) as http:
        for _ in range(n):
            jid = rng.choice(ids)
            t = time.perf_counter()
            r = http.get(f"{url}/v1/jobs/{jid}")
            out.append(time.perf_counter() - t)
            assert r.status_code == 200
    return out


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def bench(store, args):
    with tempfile.TemporaryDirectory() as tmp:
        pg = PostgresServer().start() if store == "postgresql" else None
        try:
            srv = JobServer("--api-key", KEY, "--quota-queued", "1000000", "--quota-running", "8",
                            "--job-concurrency", "8", state_dir=None if pg else tmp,
                            database=pg.url if pg else None)
            srv.start()
            try:
                body = job_body(srv.url)
                asyncio.run(submit_all(srv.url, body, 20, 4))           # warm-up
                ids, took, lat = asyncio.run(submit_all(srv.url, body, args.jobs, args.concurrency))
                status = status_latency(srv.url, ids, args.status)
            finally:
                srv.stop()
        finally:
            if pg is not None:
                pg.stop()
    return {"store": store, "jobs": args.jobs, "concurrency": args.concurrency,
            "accepted_per_s": args.jobs / took, "submit_ms_median": 1000 * statistics.median(lat),
            "submit_ms_p95": 1000 * pct(lat, 0.95), "status_ms_median": 1000 * statistics.median(status),
            "status_ms_p95": 1000 * pct(status, 0.95), "status_requests": args.status}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stores", default="sqlite,postgresql")
    p.add_argument("--jobs", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--status", type=int, default=300)
    p.add_argument("--out", default="jobs")
    args = p.parse_args(argv)
    rows = [bench(s.strip(), args) for s in args.stores.split(",") if s.strip()]
    lines = [f"# Kept jobs: submissions accepted per second and status latency ({_dt.date.today()})", "",
             f"tiny GPT-2 server (`asyncinterp serve tiny-gpt2`, 1 BLAS thread), {args.jobs} submissions from "
             f"{args.concurrency} connections while the runner runs them; {args.status} status requests; load average "
             f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at the end (a shared machine).", "",
             "| store | accepted/s | submit median ms | submit p95 ms | status median ms | status p95 ms |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['store']} | {r['accepted_per_s']:.1f} | {r['submit_ms_median']:.1f} | "
                     f"{r['submit_ms_p95']:.1f} | {r['status_ms_median']:.2f} | {r['status_ms_p95']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = HERE / "results"
    (out / f"{args.out}.json").write_text(json.dumps(rows, indent=2))
    (out / f"{args.out}.md").write_text(text)


if __name__ == "__main__":
    main()
