"""A batch of OpenAI requests against the same requests sent synchronously (requests per second).

    python benchmarks/batches.py                      # tiny GPT-2, 200 requests, ~1-2 min on 2 cores
    python benchmarks/batches.py --model smollm2 --requests 200 --max-tokens 16

The server is ``asyncinterp serve MODEL --state-dir`` in a subprocess (one BLAS thread, a batching window
of 5 ms, ``--max-batch 32``). The same ``--requests`` completions (greedy, distinct prompts of a few
lengths, ``--max-tokens`` new tokens each) are answered three ways:

* **synchronous, one at a time**: ``POST /v1/completions`` for each, the next after the previous answer
  (a script's loop over the ``openai`` client);
* **synchronous, 32 in flight**: the same from 32 concurrent connections (a client that parallelises);
* **a batch**: the lines uploaded (``POST /v1/files``), ``POST /v1/batches``, polled every 50 ms until
  ``completed``, and the output file downloaded; timed from the upload to the download.

Every answer of the batch is checked against the synchronous answer to the same request: the same
text and tokens (logprobs are not asked for: shared forward passes change them in their last bits).
Results go to ``benchmarks/results/batches.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import pathlib
import sys
import tempfile
import time

import httpx
import openai

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "src"))

from batch_helpers import CliServer, jsonl, line, read_lines, wait_batch  # noqa: E402

KEY = "bench-key"


def bodies(model: str, n: int, max_tokens: int) -> list:
    words = ["Once upon a time", "The capital of France is", "In a distant galaxy, a small ship",
             "The recipe begins with"]
    return [{"model": model, "prompt": f"{words[i % len(words)]} (case {i})", "max_tokens": max_tokens,
             "temperature": 0} for i in range(n)]


def one_at_a_time(url: str, reqs: list) -> tuple:
    out = []
    t0 = time.perf_counter()
    with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=300) as http:
        for body in reqs:
            r = http.post(f"{url}/v1/completions", json=body)
            r.raise_for_status()
            out.append(r.json())
    return time.perf_counter() - t0, out


def in_flight(url: str, reqs: list, width: int = 32) -> tuple:
    async def run():
        slots = asyncio.Semaphore(width)
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}, timeout=300,
                                     limits=httpx.Limits(max_connections=width)) as http:
            async def one(body):
                async with slots:
                    r = await http.post(f"{url}/v1/completions", json=body)
                    r.raise_for_status()
                    return r.json()
            return await asyncio.gather(*(one(b) for b in reqs))
    t0 = time.perf_counter()
    out = asyncio.run(run())
    return time.perf_counter() - t0, out


def as_batch(server: CliServer, reqs: list) -> tuple:
    client = server.client(KEY)
    lines = [line(f"r{i}", "/v1/completions", body) for i, body in enumerate(reqs)]
    t0 = time.perf_counter()
    f = client.files.create(file=("bench.jsonl", jsonl(lines)), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    b = wait_batch(client, b.id, timeout=1800)
    out = read_lines(client, b.output_file_id)
    elapsed = time.perf_counter() - t0
    client.close()
    assert b.status == "completed" and len(out) == len(reqs), b
    return elapsed, [x["response"]["body"] for x in out]


def same(a: dict, b: dict) -> bool:
    return a["choices"][0]["text"] == b["choices"][0]["text"] and a["usage"] == b["usage"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-gpt2", help="tiny-gpt2 (default) or smollm2")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--out", default=str(HERE / "results" / "batches"))
    args = p.parse_args(argv)
    reqs = bodies(args.model, args.requests, args.max_tokens)
    state = pathlib.Path(tempfile.mkdtemp(prefix="bench-batches-")) / "state"
    server = CliServer(args.model, ["--api-key", KEY, "--threads", "1", "--max-batch", "32", "--log-level",
                                    "warning"], state).start()
    try:
        one_at_a_time(server.url, reqs[:8])                        # warm-up
        t_seq, seq = one_at_a_time(server.url, reqs)
        t_par, par = in_flight(server.url, reqs)
        t_batch, batch = as_batch(server, reqs)
    finally:
        server.stop()
    mismatches = sum(not same(a, b) for a, b in zip(seq, batch))
    rows = [("synchronous, one at a time", t_seq), ("synchronous, 32 in flight", t_par),
            ("batch (upload → completed → download)", t_batch)]
    result = {"date": _dt.date.today().isoformat(), "model": args.model, "requests": args.requests,
              "max_tokens": args.max_tokens, "rows": [{"mode": m, "seconds": round(t, 2),
                                                       "requests_per_s": round(args.requests / t, 2)}
                                                      for m, t in rows],
              "batch_vs_one_at_a_time": round(t_seq / t_batch, 2), "answers_differing_from_synchronous": mismatches}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    md = [f"# A batch against the same requests sent synchronously ({result['date']})", "",
          f"`asyncinterp serve {args.model}` (1 BLAS thread, --max-batch 32), {args.requests} greedy completions "
          f"of {args.max_tokens} tokens; 2 shared cores.", "",
          "| mode | seconds | requests/s |", "|---|---|---|"]
    md += [f"| {r['mode']} | {r['seconds']} | {r['requests_per_s']} |" for r in result["rows"]]
    md += ["", f"The batch is {result['batch_vs_one_at_a_time']}x the one-at-a-time rate; answers whose text or "
               f"usage differ from the synchronous answer: {mismatches}."]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
