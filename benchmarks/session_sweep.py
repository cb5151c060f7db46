"""A causal-tracing sweep over every layer: one session against one request per trace (and the local run).

    python benchmarks/session_sweep.py                    # tiny GPT-2 with 30 layers, then SmolLM2-135M (30 layers)
    python benchmarks/session_sweep.py --models tiny30 --reps 5

The sweep: a clean run that keeps every layer's last-position activation, then one corrupted run per layer
with that layer's last position patched from the clean run, each returning the probability of the clean
run's top token. Three ways, same model, same results:

* ``local``    -- ``await sweep(lm)`` in this process (no server);
* ``session``  -- ``Client.session(sweep)``: the function travels once, its 31 traces run on the server, the
                  activations stay there, one number per layer comes back;
* ``requests`` -- 31 ``Client.trace`` calls: the clean activations come back to the client (one request) and
                  travel again, one layer's worth per patched request (30 requests).

The server is a real uvicorn on 127.0.0.1 (``Server(model, allow_code=True)``, in-process batching, one
BLAS thread). The three run in turn, ``--reps`` times (the machine's load drifts); medians. The local sweep
runs under ``torch.no_grad()``, as the server runs plain traces. Writes ``results/session_sweep.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from asyncinterp.models import smollm2, tiny  # noqa: E402
from asyncinterp.serve import Client, Server  # noqa: E402
from hostile_load import Live  # noqa: E402

CLEAN = "The Eiffel Tower is in the city of"
CORRUPT = "The Colosseum is in the city of"
N_LAYERS = 30


async def sweep(model):
    """Causal tracing at the last position over N_LAYERS layers (the same function locally and remotely)."""
    async def record(m):
        hs = [(await m.layers[i].output)[:, -1].clone() for i in range(N_LAYERS)]
        top = (await m.lm_head.output)[:, -1].argmax(-1)
        return hs, top

    clean, top = await model.atrace(CLEAN, record)
    probs = []
    for i in range(N_LAYERS):
        async def patch(m):
            h = await m.layers[i].output
            h[:, -1] = clean[i]
            return (await m.lm_head.output)[0, -1].softmax(-1)[top[0]]
        probs.append(await model.atrace(CORRUPT, patch))
    return probs


RECORD = """
async def record(m, n):
    hs = [(await m.layers[i].output)[:, -1].clone() for i in range(n)]
    return hs, (await m.lm_head.output)[:, -1].argmax(-1)
"""

PATCH = """
async def patch(m, layer, vec, top):
    h = await m.layers[layer].output
    h[:, -1] = vec
    return (await m.lm_head.output)[0, -1].softmax(-1)[top]
"""


def by_requests(client):
    clean, top = client.trace(CLEAN, RECORD, n=N_LAYERS)
    return [client.trace(CORRUPT, PATCH, layer=i, vec=clean[i], top=int(top[0])) for i in range(N_LAYERS)]


def local_sweep(model):
    with torch.no_grad():      # as the server runs plain traces (the same results; no autograd graph)
        return asyncio.run(sweep(model))


def bench(name, model, reps):
    srv = Live(Server(model, allow_code=True, max_wait_ms=2, timeout=120, code_budget=60,
                      max_body_bytes=8 << 20))
    ways = {"local": lambda: local_sweep(model), "session": None, "requests": None}
    times = {k: [] for k in ways}
    out = {}
    try:
        with Client(srv.url, timeout=300) as client:
            ways["session"] = lambda: client.session(sweep)
            ways["requests"] = lambda: by_requests(client)
            for _ in range(reps):            # interleaved: the machine's load drifts
                for k, fn in ways.items():
                    t0 = time.perf_counter()
                    out[k] = fn()
                    times[k].append(time.perf_counter() - t0)
    finally:
        srv.close()
    same = all(torch.allclose(torch.as_tensor(a), torch.as_tensor(b), atol=1e-5)
               for k in ("session", "requests") for a, b in zip(out["local"], out[k]))
    return {"model": name, **{k: statistics.median(v) for k, v in times.items()}, "same": same}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="tiny30,smollm2")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name in args.models.split(","):
        model = tiny("gpt2", n_layer=N_LAYERS) if name == "tiny30" else smollm2()
        rows.append(bench(name, model, args.reps))
        print(rows[-1], flush=True)
    lines = ["| model | local sweep | one session | 31 requests | requests / session | results equal |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {1000 * r['local']:.0f} ms | {1000 * r['session']:.0f} ms | "
                     f"{1000 * r['requests']:.0f} ms | {r['requests'] / r['session']:.2f}x | {r['same']} |")
    table = "\n".join(lines)
    print(table)
    out = HERE / "results" / "session_sweep.md"
    out.write_text("# 30-layer causal-tracing sweep: one session vs 31 requests (loopback, 1 BLAS thread)\n\n"
                   f"`python benchmarks/session_sweep.py --models {args.models} --reps {args.reps}`; medians.\n\n"
                   + table + "\n")


if __name__ == "__main__":
    main()
