"""What a remote trace costs on top of the same trace run locally (``ai.remote`` against ``model.trace``).

    python benchmarks/remote_roundtrip.py                       # tiny GPT-2 and SmolLM2-135M, ~1 min on 2 cores
    python benchmarks/remote_roundtrip.py --models tiny --reps 100 --out remote_roundtrip

The server is ``asyncinterp serve MODEL --allow-code --threads 1`` (its defaults otherwise: process
isolation, the batching window of 5 ms that a lone request no longer waits) in a
subprocess on 127.0.0.1 (as deployed); the local runs use this process's own
instance of the same model (same weights). Same prompts, same functions, one
BLAS thread on each side. Cases:

* ``read``   -- one invoke that returns the last position's logits (a [1, vocab] tensor comes back);
* ``patch``  -- activation patching: two invokes sharing an ``ai.Future`` (one request remotely);
* ``steer``  -- one invoke steering a block with a captured [hidden] tensor (closure), returns a scalar;
* ``generate`` -- 8 new tokens with a per-step read (the generation's round trip).

Rounds alternate local and remote calls (paired, so background load hits both
alike); the table gives medians in milliseconds and the remote overhead
(remote - local). The remote number is the whole round trip: capture, msgpack,
HTTP, the sandbox's rebuild of the captured source, the batcher, the same
forward (the server runs it without autograd; a local trace keeps autograd
on, as users run it), the answer.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx
import torch

import asyncinterp as ai

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
SRC = pathlib.Path(__file__).resolve().parent.parent / "src"
PROMPT = "The Eiffel Tower is in the city of"
OTHER = "The Colosseum is in the city of"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(name, extra=()):
    """``asyncinterp serve`` in a subprocess (as deployed: its own process, one BLAS thread); its URL."""
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH")) if p))
    cli = {"tiny": "tiny-gpt2", "smollm2": "smollm2"}[name]
    proc = subprocess.Popen([sys.executable, "-m", "asyncinterp.serve.cli", cli, "--port", str(port), "--allow-code",
                             "--code-budget", "30", "--timeout", "120", "--threads", "1",
                             "--log-level", "warning", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/v1/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the server did not come up")
        time.sleep(0.2)


def _models(names):
    for name in names:
        if name == "tiny":
            yield name, ai.models.tiny("gpt2")
        elif name == "smollm2":
            yield name, ai.models.smollm2()
        else:
            raise SystemExit(f"unknown model {name!r} (tiny, smollm2)")


def _cases(model):
    layers = model.standard_name("layers")
    n_layers = len(layers)
    mid = n_layers // 2
    hidden = model.module.config.hidden_size
    direction = torch.randn(hidden)

    async def read(m):
        return (await m.lm_head.output)[:, -1].clone()

    def patch_case(lm):
        clean = ai.Future()

        async def record(m):
            clean.set_result((await m.layers[mid].output)[:, -1].clone())

        async def patch(m):
            h = await m.layers[mid].output
            h[:, -1] = await clean
            return (await m.lm_head.output)[:, -1].softmax(-1)

        with lm.trace() as tr:
            tr.invoke(PROMPT, record)
            p = tr.invoke(OTHER, patch)
        return p.result

    async def steer(m):
        h = await m.layers[mid].output
        h[:] = h + 2.0 * direction
        return (await m.lm_head.output)[:, -1].max()

    async def watch(m):
        out = []
        async for _ in m.steps():
            out.append((await m.layers[mid].output)[:, -1].norm())
        return out

    return {
        "read": lambda lm: lm.trace(PROMPT, read),
        "patch": patch_case,
        "steer": lambda lm: lm.trace(PROMPT, steer),
        "generate": lambda lm: lm.generate(PROMPT, watch, max_new_tokens=8).result,
    }


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.allclose(a, b, atol=1e-4)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None, help="write benchmarks/results/<out>.md and .json")
    ap.add_argument("--cases", default=None, help="comma-separated cases to run (default: all)")
    ap.add_argument("--server-args", default="", help="more flags for `asyncinterp serve` (default: none)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    for name, local in _models(args.models.split(",")):
        proc, url = _serve(name, args.server_args.split())
        remote = ai.remote(url)
        try:
            for case, call in _cases(local).items():
                if args.cases and case not in args.cases.split(","):
                    continue
                assert _same(call(local), call(remote)), f"{name}/{case}: remote differs from local"
                for _ in range(3):   # warm both
                    call(local)
                    call(remote)
                t_local, t_remote = [], []
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    call(local)
                    t1 = time.perf_counter()
                    call(remote)
                    t2 = time.perf_counter()
                    t_local.append(t1 - t0)
                    t_remote.append(t2 - t1)
                lo, re_ = statistics.median(t_local) * 1e3, statistics.median(t_remote) * 1e3
                rows.append({"model": name, "case": case, "local_ms": round(lo, 2), "remote_ms": round(re_, 2),
                             "overhead_ms": round(re_ - lo, 2), "ratio": round(re_ / lo, 2)})
                print(f"{name:8} {case:9} local {lo:8.2f} ms   remote {re_:8.2f} ms   +{re_ - lo:7.2f} ms  "
                      f"x{re_ / lo:5.2f}", flush=True)
        finally:
            remote.close()
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    table = ["| model | case | local (ms) | remote (ms) | remote - local (ms) | remote / local |",
             "|---|---|---|---|---|---|"]
    table += [f"| {r['model']} | {r['case']} | {r['local_ms']} | {r['remote_ms']} | {r['overhead_ms']} | "
              f"{r['ratio']} |" for r in rows]
    print("\n".join(table))
    if args.out:
        meta = {"date": _dt.date.today().isoformat(), "python": sys.version.split()[0], "torch": torch.__version__,
                "threads": 1, "reps": args.reps, "cpus": os.cpu_count()}
        (RESULTS / f"{args.out}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (RESULTS / f"{args.out}.md").write_text(
            f"# remote_roundtrip.py ({meta['date']}, {args.reps} paired reps, 1 BLAS thread, medians)\n\n"
            "Server: `asyncinterp serve MODEL --allow-code --threads 1` in a subprocess (its default process "
            "isolation: the job runs in a code worker process); client: `ai.remote` in this process.\n\n"
            + "\n".join(table) + "\n")


if __name__ == "__main__":
    main()
