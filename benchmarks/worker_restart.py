"""Worker restart time under process isolation, and what a spawn-based restart would cost instead.

    python benchmarks/worker_restart.py                         # tiny-gpt2, gpt2-small, smollm2 (~3 min)
    python benchmarks/worker_restart.py --models smollm2 --crashes 20

For each model, a real server (``Server(model, isolation=ProcessIsolation(hang_timeout=1))``,
uvicorn on 127.0.0.1 in a thread of this process) with a registered intervention that
crashes its worker (``os.abort()``: trusted code standing for memory corruption):

* ``first start``  -- ``server.batcher.start()``: forking the trusted and the code worker until both are ready;
* ``restart``      -- death noticed to successor ready (``Supervisor.restart_times()``), over ``--crashes``
                      crashes (each crashing request runs alone, so it is the offender at once);
* ``serving again``-- from sending the crashing request to the answer of an innocent request sent right
                      after it (it waits for the crash, the restart and its own forward);
* ``spawn``        -- a fresh interpreter that imports asyncinterp, loads the model and runs one forward:
                      what restarting by spawn + rebuilding the model from a factory would cost.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from asyncinterp.serve import AsyncClient, RemoteError, Server  # noqa: E402
from asyncinterp.serve.cli import load_model  # noqa: E402
from asyncinterp.serve.workers.supervisor import ProcessIsolation  # noqa: E402
from hostile_load import Live  # noqa: E402

PROMPT = "The capital of France is"


async def abort_worker(m):
    await m.output
    os.abort()


async def last(m):
    return (await m.output).logits[:, -1].clone()


def spawn_seconds(name: str) -> float:
    code = ("import sys, torch; sys.path.insert(0, 'src'); from asyncinterp.serve.cli import load_model; "
            f"m = load_model({name!r}); m.trace({PROMPT!r}, lambda m: None) if False else None; "
            "import asyncinterp as ai\n"
            "async def f(m):\n    return (await m.output).logits[:, -1]\n"
            f"m.trace({PROMPT!r}, f)")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, cwd=HERE.parent, timeout=600,
                   env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
    return time.perf_counter() - t0


def bench(name: str, crashes: int) -> dict:
    model = load_model(name)
    server = Server(model, allow_code=True, timeout=60, max_wait_ms=1, builtin_interventions=False,
                    isolation=ProcessIsolation(hang_timeout=1.0))
    server.intervention("abort_worker")(abort_worker)
    server.intervention("last")(last)
    t0 = time.perf_counter()
    server.batcher.start()
    first = time.perf_counter() - t0
    live = Live(server)
    again = []
    try:
        async def go():
            async with AsyncClient(live.url, timeout=120) as c:
                await c.trace(PROMPT, "last")                     # warm: the worker's first forward
                for _ in range(crashes):
                    t = time.perf_counter()
                    crash = asyncio.ensure_future(c.trace(PROMPT, "abort_worker"))
                    await asyncio.sleep(0.005)
                    await c.trace(PROMPT, "last")
                    again.append(time.perf_counter() - t)
                    try:
                        await crash
                    except RemoteError as exc:
                        assert exc.kind == "crashed", exc
                    await c.trace(PROMPT, "last")                 # the successor's first forward, out of the way
        asyncio.run(go())
        restarts = server.batcher.restart_times()
    finally:
        live.close()
    return {"model": name, "first": first, "restart": statistics.median(restarts), "restart_max": max(restarts),
            "again": statistics.median(again), "n": len(restarts)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny-gpt2,gpt2-small,smollm2")
    ap.add_argument("--crashes", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.models.split(","):
        row = bench(name, args.crashes)
        row["spawn"] = spawn_seconds(name)
        rows.append(row)
        print(row, flush=True)
    print("\n| model | first start (2 workers) | restart, median (max) | serving again after a crash, median | "
          "spawn + load + first forward |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {1000 * r['first']:.0f} ms | {1000 * r['restart']:.0f} ms "
              f"({1000 * r['restart_max']:.0f}) | {1000 * r['again']:.0f} ms | {r['spawn']:.1f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
