"""Harvest throughput on SmolLM2 (fp32): ai.harvest against the floor and the field's tools, on the same windows.

One run measures, each system in its own subprocess (its own peak RSS; one vLLM engine per process), in
alternating rounds, the tokens/s of harvesting ``blocks.6.hook_resid_post`` (the output of decoder layer 6)
over the same windows (SAELens's windowing of a text corpus made here, ``--context`` tokens each):

* ``hooks``: a hand-written loop, the floor: a torch forward hook on ``model.layers[6]`` that copies the
  output and stops the forward (as ai.harvest does), the same Arrow shards written with datasets' ArrowWriter;
* ``ai-transformers``: ``ai.harvest`` on ``ai.LanguageModel`` (manifest, resumable shards, same files);
* ``vllm-plain``: vLLM's own throughput on the same windows, prompt only (``max_tokens=1``), nothing captured,
  all windows submitted at once;
* ``ai-vllm``: ``ai.harvest`` on ``ai.VLLM`` (the same engine settings);
* ``saelens``: SAELens's ``CacheActivationsRunner`` (``AutoModelForCausalLM`` from the local directory: its
  ``HookedTransformer`` path needs a download), hook ``model.layers.6``, the windows as a pre-tokenised dataset;
* ``nnsight``: nnsight 0.8.1 (``.venv-bench``, which has no ``datasets``: the values go to ``.npy`` shards of the
  same bytes) reading ``model.layers[6].output`` and stopping the trace there.

    python benchmarks/harvest.py --windows 48 --rounds 2      # writes benchmarks/results/harvest.md
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# this folder has a vllm.py of its own: never let it shadow the vllm package
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
POINT = "blocks.6.hook_resid_post"
LAYER = 6


def _texts(n):
    topics = ["the river", "a small bird", "the old city", "seven mountains", "the quiet library", "a red fox",
              "the night train", "an open window", "a long letter", "the winter market"]
    verbs = ["remembers", "watches", "follows", "sings about", "waits for", "forgets", "describes"]
    return [f"{topics[i % 10].capitalize()} {verbs[i % 7]} {topics[(3 * i + 1) % 10]} while "
            f"{topics[(7 * i + 2) % 10]} {verbs[(i + 3) % 7]} {topics[(i + 5) % 10]}. " * (2 + i % 5)
            for i in range(n)]


def prepare(work, n_windows, context):
    """The windows (SAELens's packing of the corpus), as a pre-tokenised dataset and a .pt file."""
    import datasets
    import torch
    from transformers import AutoTokenizer

    from asyncinterp.harvesting.windows import WindowSpec, windows
    from asyncinterp.models.hf.bundled import smollm2_dir
    model_dir = str(smollm2_dir())
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = datasets.Dataset.from_dict({"text": _texts(40 * n_windows)})
    out = []
    for w in windows(texts, WindowSpec(context_size=context), tok):
        out.append(w)
        if len(out) == n_windows:
            break
    assert len(out) == n_windows, "the corpus is too small for --windows"
    ds = datasets.Dataset.from_dict({"input_ids": out})
    ds.save_to_disk(os.path.join(work, "windows"))
    torch.save(torch.tensor(out, dtype=torch.long), os.path.join(work, "windows.pt"))
    return model_dir


# ------------------------------------------------------------------------------------------- the systems
def run_hooks(model_dir, work, out, batch, shard):
    import datasets
    import numpy as np
    import torch
    from datasets.arrow_writer import ArrowWriter
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids_all = torch.load(os.path.join(work, "windows.pt"))
    n, t = ids_all.shape
    d = hf.config.hidden_size
    feats = datasets.Features({POINT: datasets.Array2D((t, d), "float32"),
                               "token_ids": datasets.Sequence(datasets.Value("int32"), length=t)})

    class Stop(Exception):
        pass
    got = {}

    def hook(module, args, output):
        got["h"] = output.detach().clone()
        raise Stop

    os.makedirs(out)
    start = time.perf_counter()
    handle = hf.model.layers[LAYER].register_forward_hook(hook)
    buf = np.empty((shard, t, d), np.float32)
    with torch.no_grad():
        for s0 in range(0, n, shard):
            rows = ids_all[s0:s0 + shard]
            for b0 in range(0, len(rows), batch):
                try:
                    hf(rows[b0:b0 + batch])
                except Stop:
                    pass
                h = got["h"].numpy()
                buf[b0:b0 + len(h)] = h       # the last batch of a shard may be short
            w = ArrowWriter(features=feats, path=os.path.join(out, f"data-{s0 // shard:05d}.arrow"))
            w.write_batch({POINT: buf[:len(rows)], "token_ids": rows.numpy().astype(np.int32)})
            w.finalize()
    handle.remove()
    return time.perf_counter() - start, n * t


def run_ai_transformers(model_dir, work, out, batch, shard):
    import asyncinterp as ai
    import torch
    lm = ai.LanguageModel.from_pretrained(model_dir, dtype=torch.float32)
    start = time.perf_counter()
    r = ai.harvest(lm, os.path.join(work, "windows"), [POINT], out, context_size=_ctx(work), batch_size=batch,
                   shard_windows=shard, progress=False)
    return r.seconds, r.tokens, time.perf_counter() - start


def _vllm(model_dir, context):
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import asyncinterp as ai
    return ai.VLLM(model_dir, dtype="float32", max_model_len=max(256, context + 8),
                   kv_cache_memory_bytes=512 << 20, seed=0)


def run_vllm_plain(model_dir, work, out, batch, shard):
    import torch
    from vllm import SamplingParams
    ids = torch.load(os.path.join(work, "windows.pt")).tolist()
    vm = _vllm(model_dir, len(ids[0]))
    vm.llm.generate([{"prompt_token_ids": ids[0]}], SamplingParams(max_tokens=1), use_tqdm=False)   # warm
    start = time.perf_counter()
    outs = vm.llm.generate([{"prompt_token_ids": w} for w in ids], SamplingParams(max_tokens=1, temperature=0.0),
                           use_tqdm=False)
    took = time.perf_counter() - start
    assert len(outs) == len(ids)
    vm.close()
    return took, len(ids) * len(ids[0])


def run_ai_vllm(model_dir, work, out, batch, shard):
    import torch
    from vllm import SamplingParams

    import asyncinterp as ai
    ids = torch.load(os.path.join(work, "windows.pt")).tolist()
    vm = _vllm(model_dir, len(ids[0]))
    vm.llm.generate([{"prompt_token_ids": ids[0]}], SamplingParams(max_tokens=1), use_tqdm=False)   # warm
    start = time.perf_counter()
    r = ai.harvest(vm, os.path.join(work, "windows"), [POINT], out, context_size=len(ids[0]), batch_size=shard,
                   shard_windows=shard, progress=False)
    took = time.perf_counter() - start
    vm.close()
    return r.seconds, r.tokens, took


def run_saelens(model_dir, work, out, batch, shard):
    import datasets
    import torch
    from sae_lens import CacheActivationsRunner
    from sae_lens.config import CacheActivationsRunnerConfig
    ds = datasets.load_from_disk(os.path.join(work, "windows"))
    n, t = len(ds), len(ds[0]["input_ids"])
    cfg = CacheActivationsRunnerConfig(
        dataset_path="unused", model_name=model_dir, model_class_name="AutoModelForCausalLM", model_batch_size=batch,
        hook_name=f"model.layers.{LAYER}", d_in=576, training_tokens=n * t, context_size=t, device="cpu",
        new_cached_activations_path=out, shuffle=False, dtype="float32", prepend_bos=False,
        buffer_size_gb=shard * t * 576 * 4 / 1e9, model_from_pretrained_kwargs={"dtype": torch.float32})
    runner = CacheActivationsRunner(cfg, override_dataset=ds)
    start = time.perf_counter()
    result = runner.run()
    took = time.perf_counter() - start
    return took, len(result) * t


NNSIGHT = r'''
import os, sys, time, json, resource
import numpy as np, torch
from transformers import AutoModelForCausalLM
from nnsight import NNsight
model_dir, work, out, batch, shard, layer = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7])
hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
model = NNsight(hf)
ids_all = torch.load(os.path.join(work, "windows.pt"))
n, t = ids_all.shape
os.makedirs(out)
buf = np.empty((shard, t, hf.config.hidden_size), np.float32)
start = time.perf_counter()
with torch.no_grad():
    for s0 in range(0, n, shard):
        rows = ids_all[s0:s0 + shard]
        for b0 in range(0, len(rows), batch):
            with model.trace(rows[b0:b0 + batch]) as tracer:
                h = model.model.layers[layer].output.save()
                tracer.stop()
            buf[b0:b0 + len(h)] = h.detach().numpy()
        np.save(os.path.join(out, f"data-{s0 // shard:05d}.npy"), buf[:len(rows)])
took = time.perf_counter() - start
print(json.dumps({"seconds": took, "tokens": n * t,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
'''

SYSTEMS = {"hooks": run_hooks, "ai-transformers": run_ai_transformers, "vllm-plain": run_vllm_plain,
           "ai-vllm": run_ai_vllm, "saelens": run_saelens}


def _ctx(work):
    import torch
    return int(torch.load(os.path.join(work, "windows.pt")).shape[1])


def child(name, model_dir, work, out, batch, shard):
    took, tokens, *whole = SYSTEMS[name](model_dir, work, out, batch, shard)
    print(json.dumps({"seconds": took, "tokens": tokens, "with_setup": whole[0] if whole else took,
                      "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def measure(name, model_dir, work, batch, shard, timeout):
    out = os.path.join(work, f"out-{name}")
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    if name == "nnsight":
        bench_py = os.path.join(ROOT, ".venv-bench", "bin", "python")
        if not os.path.exists(bench_py):
            bench_py = "/work/main/.venv-bench/bin/python"
        cmd = [bench_py, "-c", NNSIGHT, model_dir, work, out, str(batch), str(shard), str(LAYER)]
    else:
        cmd = [sys.executable, __file__, "--child", name, "--model-dir", model_dir, "--work", work, "--out", out,
               "--batch", str(batch), "--shard", str(shard)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"error": (p.stderr or p.stdout).strip().splitlines()[-1][:300] if (p.stderr or p.stdout) else
                f"exit {p.returncode}"}
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=48)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--shard", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--systems", default="hooks,ai-transformers,vllm-plain,ai-vllm,saelens,nnsight")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results", "harvest.md"))
    ap.add_argument("--child")
    ap.add_argument("--model-dir")
    ap.add_argument("--work")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.model_dir, args.work, args.out, args.batch, args.shard)
    work = tempfile.mkdtemp(prefix="harvest-bench-")
    model_dir = prepare(work, args.windows, args.context)
    systems = args.systems.split(",")
    runs = {s: [] for s in systems}
    for r in range(args.rounds):
        for s in (systems if r % 2 == 0 else systems[::-1]):
            res = measure(s, model_dir, work, args.batch, args.shard, args.timeout)
            runs[s].append(res)
            print(f"round {r} {s}: {res}", flush=True)

    def best(s):
        ok = [x for x in runs[s] if "error" not in x]
        return max(ok, key=lambda x: x["tokens"] / x["seconds"]) if ok else None
    rate = {s: (best(s)["tokens"] / best(s)["seconds"] if best(s) else None) for s in systems}
    lines = [f"# Harvest throughput: SmolLM2-135M fp32, {args.windows} windows x {args.context} tokens "
             f"({args.windows * args.context} tokens), point {POINT}, batch {args.batch}, shard {args.shard}",
             "", f"`python benchmarks/harvest.py --windows {args.windows} --rounds {args.rounds}`; best of "
             f"{args.rounds} rounds (alternating order), each system in its own process; machine: "
             f"{os.cpu_count()} cores, load average at the end {os.getloadavg()[0]:.1f}.", "",
             "tokens/s counts the harvest loop (windows in, files out); for ai.harvest the column `with setup` "
             "adds what a call does before its loop (the manifest: a sha256 of the weights, the dataset's "
             "fingerprint), paid once per call.", "",
             "| system | tokens/s | ratio | with setup (tok/s) | peak RSS (MB) |", "|---|---|---|---|---|"]
    ref = {"hooks": "hooks", "ai-transformers": "hooks", "vllm-plain": "vllm-plain", "ai-vllm": "vllm-plain",
           "saelens": "hooks", "nnsight": "hooks"}
    for s in systems:
        b = best(s)
        if b is None:
            lines.append(f"| {s} | - | - | - | failed: {runs[s][-1].get('error')} |")
            continue
        base = rate.get(ref[s])
        ratio = f"{rate[s] / base:.2f}x {ref[s]}" if base and s != ref[s] else "1.00"
        setup = b["tokens"] / b.get("with_setup", b["seconds"])
        lines.append(f"| {s} | {rate[s]:,.0f} | {ratio} | {setup:,.0f} | {b['rss_mb']:,.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(args.results), exist_ok=True)
    with open(args.results, "w") as f:
        f.write(text)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
