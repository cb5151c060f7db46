"""Serving on vLLM: vLLM's own OpenAI server vs ``asyncinterp serve --engine vllm``, same model and engine.

    python benchmarks/serving_vllm.py                       # SmolLM2-135M, 128 requests x 32 tokens, 32 clients
    python benchmarks/serving_vllm.py --requests 64 --out latest

Both servers run in a subprocess, one after the other (never at once: the
machine's cores are shared), over the same model directory and the same
engine arguments (float32, eager, ``--max-model-len``, ``--kv-cache-memory-bytes``, seed 0). The client is
the same: ``--clients`` concurrent streaming clients (closed loop) send
``--requests`` OpenAI ``/v1/completions`` requests (``stream: true``,
greedy, ``max_tokens`` new tokens each). Cases:

* ``vllm``           -- vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``);
* ``ai plain``       -- ``asyncinterp serve --engine vllm``, no intervention;
* ``ai read/step``   -- the same server, every request carrying an intervention in the
                        ``asyncinterp`` extension field that reads one layer's output at
                        every step and returns one float per step (``read_norm``, registered
                        from benchmarks/serving_vllm_interventions.py);
* ``ai read/step, full vectors`` -- the built-in ``read``: the same read, returning the whole
                        576-wide vector of every step (18,432 floats of JSON per request);
* ``vllm logprobs=5`` / ``ai logprobs=5`` -- plain requests asking ``logprobs: 5`` (each
                        streamed token with its 5 most likely alternatives), on each server;
                        the ``ai`` case is compared with vLLM's server's ``logprobs=5`` case.
* ``ai named edit``  -- the same server, every request naming ``model:calm`` (a named edit
                        installed with ``--edit calm=benchmarks/serving_vllm_interventions.py:calm``,
                        which scales one layer's residual stream every forward pass), no extension field.

``--cases`` runs a subset by case name (vLLM's server runs only when one of its cases is chosen).

Reported per case: requests/s, tokens/s, time to first token p50/p95,
latency p50/p95; and the *short-behind-long probe*: a streaming request of
``--long-tokens`` tokens runs alone; once it has streamed 16 tokens a short
request (4 tokens) is sent, and its time to first token is compared with the
long request's median inter-token time (one engine step).
Targets (issue 9): throughput >= 0.9x vLLM's server without interventions and
>= 0.85x with the per-step read; TTFT p50 <= 1.5x vLLM's; the short request's
first token within 3 engine steps. Issue 22: with ``logprobs=5``, >= 0.9x vLLM's
throughput with the same field and TTFT p50 <= 1.5x.
"""

from __future__ import annotations

import argparse
import asyncio
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

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = [
    "The history of the printing press begins",
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue in simple words:",
    "List three facts about the moon:",
    "Once upon a time in a small village,",
    "The best way to learn a new language is",
    "In computer science, a hash table is",
    "My favourite recipe for pancakes needs",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


# ----------------------------------------------------------------------------- servers

class Server:
    """A server subprocess; ``wait_ready`` polls its health route."""

    def __init__(self, name, cmd, port, health, env=None, log_path=None):
        self.name = name
        self.port = port
        self.health = health
        self.log = open(log_path or os.devnull, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.started = time.monotonic()

    def wait_ready(self, timeout=600):
        import httpx
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it was ready")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}{self.health}", timeout=2).status_code == 200:
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} was not ready after {timeout} s")

    def stop(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self.log.close()


def vllm_server(model_dir, args, port, log_path):
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--served-model-name", "model", "--dtype", "float32", "--enforce-eager", "--seed", "0",
           "--max-model-len", str(args.max_model_len), "--kv-cache-memory-bytes", str(args.kv_bytes),
           "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log"]
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    return Server("vllm", cmd, port, "/health", env=env, log_path=log_path)


def ai_server(model_dir, args, port, log_path):
    cmd = [sys.executable, "-m", "asyncinterp.cli", "serve", model_dir, "--engine", "vllm",
           "--served-model-name", "model", "--dtype", "float32", "--seed", "0",
           "--max-model-len", str(args.max_model_len), "--kv-cache-memory-bytes", str(args.kv_bytes),
           "--port", str(port), "--timeout", "600",
           "--max-queue", "1024", "--log-level", "warning",
           "--interventions", os.path.join(HERE, "serving_vllm_interventions.py"),
           "--edit", f"calm={os.path.join(HERE, 'serving_vllm_interventions.py')}:calm"]
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    return Server("asyncinterp", cmd, port, "/v1/health", env=env, log_path=log_path)


# ----------------------------------------------------------------------------- client

async def one_request(client, url, prompt, max_tokens, extra=None):
    """One streaming completion: (ttft, latency, tokens, inter-token gaps)."""
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if extra:
        body.update(extra)
    t0 = time.perf_counter()
    first = None
    stamps = []
    usage = None
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data.strip() == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                if choice.get("text"):
                    now = time.perf_counter()
                    stamps.append(now)
                    if first is None:
                        first = now - t0
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else len(stamps)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return (first if first is not None else end - t0), end - t0, tokens, gaps


async def load(port, args, extra=None):
    import httpx
    url = f"http://127.0.0.1:{port}/v1/completions"
    results = []
    counter = iter(range(args.requests))

    async def client_loop(client):
        for i in counter:
            results.append(await one_request(client, url, PROMPTS[i % len(PROMPTS)], args.max_tokens, extra))

    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one_request(client, url, PROMPTS[0], 4, extra)          # warm-up
        t0 = time.perf_counter()
        await asyncio.gather(*[client_loop(client) for _ in range(args.clients)])
        wall = time.perf_counter() - t0
    ttft = [r[0] for r in results]
    lat = [r[1] for r in results]
    tokens = sum(r[2] for r in results)
    return {"requests": len(results), "wall_s": wall, "req_s": len(results) / wall, "tok_s": tokens / wall,
            "ttft_p50": pct(ttft, 50), "ttft_p95": pct(ttft, 95), "lat_p50": pct(lat, 50), "lat_p95": pct(lat, 95),
            "tokens": tokens}


async def probe(port, args, extra=None):
    """Short behind long: the short request's TTFT in units of the long one's median step."""
    import httpx
    url = f"http://127.0.0.1:{port}/v1/completions"
    async with httpx.AsyncClient(timeout=600) as client:
        await one_request(client, url, PROMPTS[1], 4, extra)
        body = {"model": "model", "prompt": PROMPTS[4], "max_tokens": args.long_tokens, "temperature": 0.0,
                "stream": True}     # (extra may name another model: a named edit)
        if extra:
            body.update(extra)
        started = asyncio.Event()
        gaps = []

        async def long():
            last = None
            n = 0
            async with client.stream("POST", url, json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and line[6:].strip() != "[DONE]":
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
                        n += 1
                        if n == 16:
                            started.set()
            started.set()      # it ended early (end of sequence): the probe then measures an idle engine

        task = asyncio.create_task(long())
        await started.wait()
        ttft, _, _, _ = await one_request(client, url, PROMPTS[2], 4, extra)
        await task
    step = statistics.median(gaps) if gaps else float("nan")
    return {"short_ttft_s": ttft, "long_step_s": step, "short_ttft_steps": ttft / step if step else float("nan")}


# ----------------------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=None, help="model directory (default: the bundled SmolLM2-135M)")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--long-tokens", type=int, default=192)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--kv-bytes", type=int, default=1 << 30, help="KV cache size, both servers (default 1 GiB)")
    ap.add_argument("--layer", default="model.layers.15", help="module the per-step read intervention reads")
    ap.add_argument("--cases", default=None,
                    help="comma-separated case names to run (default: all), e.g. 'vllm,ai plain,ai named edit'")
    ap.add_argument("--out", default=None, help="write benchmarks/results/serving_vllm-OUT.{json,md}")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    model_dir = args.model_dir
    if model_dir is None:
        from asyncinterp.models.hf.bundled import smollm2_dir
        model_dir = str(smollm2_dir())
    read = {"asyncinterp": {"intervention": "read_norm", "params": {"module": args.layer}}}
    read_all = {"asyncinterp": {"intervention": "read", "params": {"module": args.layer, "position": -1}}}
    logprobs = {"logprobs": 5}
    edit = {"model": "model:calm"}        # a named edit, chosen by the model name alone
    logdir = os.path.join(HERE, "results", "logs")
    os.makedirs(logdir, exist_ok=True)
    rows = {}
    meta = {"model_dir": model_dir, "requests": args.requests, "clients": args.clients,
            "max_tokens": args.max_tokens, "python": platform.python_version(), "cpus": os.cpu_count(),
            "date": _dt.datetime.now().isoformat(timespec="seconds")}
    for name, make, cases in (("vllm", vllm_server, [("vllm", None), ("vllm logprobs=5", logprobs)]),
                              ("asyncinterp", ai_server, [("ai plain", None), ("ai read/step", read),
                                                               ("ai read/step, full vectors", read_all),
                                                               ("ai logprobs=5", logprobs),
                                                               ("ai named edit", edit)])):
        if args.cases is not None:
            wanted = {c.strip() for c in args.cases.split(",")}
            cases = [(case, extra) for case, extra in cases if case in wanted]
            if not cases:
                continue
        port = free_port()
        server = make(model_dir, args, port, os.path.join(logdir, f"serving_vllm-{name}.log"))
        try:
            meta[f"{name}_start_s"] = round(server.wait_ready(), 1)
            print(f"{name} ready in {meta[f'{name}_start_s']} s", flush=True)
            for case, extra in cases:
                row = asyncio.run(load(port, args, extra))
                row.update(asyncio.run(probe(port, args, extra)))
                rows[case] = row
                print(case, json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
                      flush=True)
        finally:
            server.stop()
    try:
        meta["load_avg_end"] = os.getloadavg()[0]
    except OSError:
        pass
    table = render(rows, meta)
    print(table)
    if args.out:
        base = os.path.join(HERE, "results", f"serving_vllm-{args.out}")
        with open(base + ".json", "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(base + ".md", "w") as f:
            f.write(table + "\n")


def render(rows, meta) -> str:
    lines = [f"Serving on vLLM: {os.path.basename(meta['model_dir'])}, {meta['requests']} requests x "
             f"{meta['max_tokens']} tokens, {meta['clients']} streaming clients, greedy "
             f"({meta['cpus']} CPUs, {meta['date']})", "",
             "| case | req/s | tok/s | vs vLLM (same fields) |"
             " TTFT p50 s | TTFT p95 s | TTFT p50 vs vLLM | latency p50 s | "
             "latency p95 s | short behind long: TTFT s (engine steps) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for case, r in rows.items():
        base = rows.get("vllm logprobs=5" if "logprobs" in case else "vllm")
        ratio = r["tok_s"] / base["tok_s"] if base else float("nan")
        tt = r["ttft_p50"] / base["ttft_p50"] if base else float("nan")
        lines.append(f"| {case} | {r['req_s']:.2f} | {r['tok_s']:.0f} | {ratio:.2f}x | {r['ttft_p50']:.3f} | "
                     f"{r['ttft_p95']:.3f} | {tt:.2f}x | {r['lat_p50']:.3f} | {r['lat_p95']:.3f} | "
                     f"{r['short_ttft_s']:.3f} ({r['short_ttft_steps']:.1f}) |")
    lines.append("")
    lines.append(f"server start: vLLM {meta.get('vllm_start_s')} s, asyncinterp {meta.get('asyncinterp_start_s')} s; "
                 f"load average at the end {meta.get('load_avg_end', float('nan')):.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
