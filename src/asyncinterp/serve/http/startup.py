"""What every serving process does at start: read the options, build the model and the server, set up the log.

Shared by the command (:mod:`asyncinterp.serve.cli`), each Ray Serve replica
(:mod:`asyncinterp.serve.scale.ray_app`) and the ranks of a tensor-parallel
server (:mod:`asyncinterp.serve.scale.tp_serve`), which run it in each rank
process. The command only chooses between one server, replicas and ranks.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


__all__ = ["api_keys", "build_model", "choose_isolation", "configure", "engine_options", "gpt2_small",
           "load_interventions", "load_model", "load_vllm", "make_server", "prepare_process", "serve_forever",
           "serve_one", "setup_logging"]


def load_interventions(server, path: str) -> None:
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"asyncinterp_user_interventions_{abs(hash(path))}", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"cannot load interventions from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    register = getattr(module, "register", None)
    if register is None:
        raise ValueError(f"{path} must define register(server), which adds interventions with "
                         "@server.intervention('name')")
    register(server)


def setup_logging(fmt: str, level: str) -> None:
    from .reach import JsonFormatter
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s %(fields)s", defaults={"fields": ""}))
    logger = logging.getLogger("asyncinterp.serve")
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False


def configure(p: argparse.ArgumentParser) -> None:
    """The options of ``asyncinterp serve`` that every serving process reads (scale-out adds its own)."""
    p.add_argument("model", nargs="?", default="smollm2", metavar="MODEL",
                   help="smollm2 (default), tiny-gpt2, tiny-llama, gpt2-small, or a transformers model directory")
    p.add_argument("--engine", choices=["transformers", "vllm"], default="transformers",
                   help="transformers (default: ai.LanguageModel) or vllm (ai.VLLM, an in-process vLLM engine)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name in /v1/models and OpenAI requests (default: MODEL as given)")
    g = p.add_argument_group("vLLM engine options (with --engine vllm)")
    g.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                   help="tensor-parallel workers (also on transformers: N ranks, tp_plan='auto', gloo; "
                        "docs/tensor-parallel.md)")
    g.add_argument("--dtype", default=None,
                   help="weights' dtype (default: float32 without a GPU, vLLM's 'auto' with one)")
    g.add_argument("--max-model-len", type=int, default=None, metavar="N", help="context length (prompt + new)")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None, metavar="N", help="KV cache size in bytes")
    g.add_argument("--max-num-seqs", type=int, default=None, metavar="N", help="most requests per engine step")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N", help="token budget per step")
    g.add_argument("--seed", type=int, default=None, help="the engine's random seed")
    g.add_argument("--disable-log-stats", action="store_true", default=None,
                   help="as vLLM's server: do not record the engine's statistics (then /metrics has no vllm:* "
                        "families; by default they are recorded and shown)")
    g.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="any other vllm.LLM keyword (repeatable; VALUE is parsed as JSON when it can be)")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="OpenAI answers report usage.prompt_tokens_details.cached_tokens (vLLM's prefix-cache hits; "
                        "tells clients whether others sent the same prompt prefix, see docs/serving.md)")
    p.add_argument("--host", default="127.0.0.1", help="loopback address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="accepted API key (repeatable); also $ASYNCINTERP_API_KEYS (comma separated)")
    p.add_argument("--allow-code", action="store_true",
                   help="accept client-submitted `async def` source (restricted sandbox; trusted users only)")
    p.add_argument("--interventions", metavar="FILE", action="append", default=[],
                   help="Python file defining register(server) with your named interventions (repeatable)")
    p.add_argument("--no-builtins", action="store_true", help="do not register top_k/read/steer/ablate")
    p.add_argument("--edit", action="append", default=[], metavar="NAME=SPEC",
                   help="install a named edit, chosen by OpenAI requests as model='MODEL:NAME' (repeatable; "
                        "'MODEL:a+b' combines): NAME=FILE.py:FUNCTION (an async def fn(m), run every forward "
                        "pass) or NAME=INTERVENTION:k=v,... (a registered intervention with fixed parameters); "
                        "see docs/serving.md")
    p.add_argument("--lora-modules", action="extend", nargs="+", default=[], metavar="NAME=PATH",
                   help="serve LoRA adapters (peft directories) under the model names NAME, as vLLM's server does "
                        "(--lora-modules a=PATH b=PATH, or repeated; vLLM's JSON form {\"name\": ..., \"path\": ...} "
                        "too); listed by /v1/models; --engine vllm applies each to the requests naming it, alone "
                        "or under named edits (MODEL is then given before this option)")
    p.add_argument("--max-batch", type=int, default=32, help="most requests per forward pass (default 32)")
    p.add_argument("--max-wait-ms", type=float, default=5.0,
                   help="the most a batch waits for requests already on their way to share its forward (default 5 ms); "
                        "a request on an idle engine starts at once, and those that come while a forward runs "
                        "join the next one")
    p.add_argument("--max-queue", type=int, default=256, help="waiting requests before 503 (default 256)")
    p.add_argument("--timeout", type=float, default=30.0, help="per-request time limit in seconds (default 30)")
    p.add_argument("--code-budget", type=float, default=1.0,
                   help="CPU seconds submitted code may run per request, counted only while its own code runs "
                        "(default 1); past it the code is stopped and the others' forward goes on")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request size limit (default 1 MiB)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="generation limit per request (default 256)")
    p.add_argument("--exact", action="store_true",
                   help="only batch prompts of equal token length together (no padding)")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic CPU BLAS (MKL_CBWR=AUTO,STRICT): with --exact, batched results are "
                        "bit-equal to solo runs on batch-invariant models")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--cache-dir", default=None, help="where the converted SmolLM2 lives")
    p.add_argument("--log-format", choices=["json", "text"], default="json", help="request log format")
    p.add_argument("--log-level", default="info", help="log level (default info)")
    p.add_argument("--allow-non-loopback", action="store_true",
                   help="allow binding a non-loopback address (put TLS and a real auth layer in front!)")
    p.add_argument("--isolation", choices=["auto", "thread", "process"], default="auto",
                   help="process: run the model and all interventions in supervised worker processes, killed and "
                        "restarted when they hang, crash or run out of memory; thread: in this process. auto "
                        "(default): process with --allow-code, else thread")
    p.add_argument("--hang-timeout", type=float, default=5.0,
                   help="with process isolation: seconds without a heartbeat before a worker is killed (default 5)")
    p.add_argument("--worker-memory-mb", type=int, default=4096,
                   help="with process isolation: MiB a worker may grow beyond its size at start (default 4096; "
                        "0: no limit)")
    from ..jobs.durable.options import add_arguments as add_kept_job_arguments
    add_kept_job_arguments(p)     # --state-dir, --database, --admin-key, --job-*, --quota-* (docs/jobs.md)


_VLLM_FLAGS = ("tensor_parallel_size", "dtype", "max_model_len", "kv_cache_memory_bytes", "max_num_seqs",
               "max_num_batched_tokens", "seed", "disable_log_stats")


def engine_options(args) -> dict:
    """The ``vllm.LLM`` keywords the command line asks for (``--engine vllm`` only)."""
    import json
    options = {k: getattr(args, k) for k in _VLLM_FLAGS if getattr(args, k, None) is not None}
    for item in getattr(args, "engine_arg", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-arg takes KEY=VALUE, got {item!r}")
        try:
            options[key.replace("-", "_")] = json.loads(value)
        except ValueError:
            options[key.replace("-", "_")] = value
    if getattr(args, "engine", "transformers") != "vllm":
        options.pop("tensor_parallel_size", None)   # transformers: ranks of its own (serve/scale/tp_serve.py)
        if options:
            raise ValueError(f"{sorted(options)}: engine options need --engine vllm")
        return {}
    # as vLLM's server (not its offline LLM): statistics on unless --disable-log-stats, labelled with the name
    # clients use, so /metrics carries vLLM's own families (serve/http/metrics.py)
    options.setdefault("disable_log_stats", False)
    options.setdefault("served_model_name", getattr(args, "served_model_name", None) or args.model)
    if "dtype" not in options:
        import torch
        options["dtype"] = "auto" if torch.cuda.is_available() else "float32"
    return options


def build_model(args):
    """The model the command line asks for: the one place where the serving engine is chosen and made."""
    options = engine_options(args)
    if args.engine == "vllm":
        if getattr(args, "lora_modules", None):   # served by name (model_names); the engine applies them per request
            from ..openai.model_names import parse_lora_option
            options["lora_modules"] = dict(parse_lora_option(text) for text in args.lora_modules)
        return load_vllm(args.model, args.cache_dir, **options)
    return load_model(args.model, args.cache_dir)


def load_vllm(name: str, cache_dir=None, **engine_kwargs):
    """``ai.VLLM`` over the bundled SmolLM2 (``smollm2``, converted once) or a model directory."""
    if name == "smollm2":
        from ...models.hf.bundled import smollm2_dir
        directory = str(smollm2_dir(cache_dir))
    elif os.path.isdir(name):
        directory = name
    else:
        raise FileNotFoundError(f"--engine vllm serves a model directory or smollm2, not {name!r}")
    from ...models.vllm import VLLM
    return VLLM(directory, **engine_kwargs)


def load_model(name: str, cache_dir=None):
    """A LanguageModel for a CLI model name or directory."""
    from ...models import smollm2, tiny
    if name == "smollm2":
        return smollm2(cache_dir=cache_dir)
    if name in ("tiny", "tiny-gpt2"):
        return tiny("gpt2")
    if name == "tiny-llama":
        return tiny("llama")
    if name == "gpt2-small":
        return gpt2_small()
    if os.path.isdir(name):
        from ...models.hf.language import LanguageModel
        return LanguageModel.from_pretrained(name)
    raise FileNotFoundError(f"unknown model {name!r}: use smollm2, tiny-gpt2, tiny-llama, gpt2-small or a "
                            "transformers model directory")


def gpt2_small(seed: int = 0):
    """A GPT-2-small-shaped model (12 layers, width 768) with random weights and the real GPT-2 tokenizer."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from ...models.hf.bundled import gpt2_tokenizer
    from ...models.hf.language import LanguageModel
    tok = gpt2_tokenizer()
    config = GPT2Config(vocab_size=len(tok), n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(config).eval()
    return LanguageModel(model, tok)


def prepare_process(args) -> None:
    """What the command line sets for this process before a model loads: BLAS determinism, logs, threads."""
    if args.deterministic:
        os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")  # read by MKL at its first call, which is still ahead
    setup_logging(args.log_format, args.log_level)
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)


def api_keys(args) -> list:
    """The accepted API keys: ``--api-key`` and ``$ASYNCINTERP_API_KEYS`` (comma separated)."""
    return list(args.api_key) + [k.strip() for k in os.environ.get("ASYNCINTERP_API_KEYS", "").split(",")
                                 if k.strip()]


def serve_forever(args, model, keys, log) -> int:
    """Build the server over ``model`` and serve it with uvicorn until the process is asked to stop."""
    server = make_server(args, model, keys, log)
    import uvicorn
    config = uvicorn.Config(server.asgi, host=args.host, port=args.port, log_level="warning", access_log=False)
    userver = uvicorn.Server(config)
    log.info("serving", extra={"fields": {"event": "startup", "model": server.name, "engine": server.front.kind,
                                          "host": args.host,
                                          "port": args.port, "interventions": sorted(server.interventions),
                                          "models": [n for n, _ in server.names.listed()],
                                          "weights": server.receipts.weights,
                                          "allow_code": args.allow_code,
                                          "isolation": "process" if server.supervised else "thread"}})
    userver.run()
    return 0


def make_server(args, model, keys, log):
    """The :class:`~.app.Server` the command line asks for, over ``model``, ready to take requests (its worker
    processes started); shared by ``asyncinterp serve`` and each Ray Serve replica (:mod:`.ray_app`)."""
    from .app import Server
    isolation = choose_isolation(args, model, log)
    server = Server(model, api_keys=keys, allow_code=args.allow_code, max_batch=args.max_batch,
                    max_wait_ms=args.max_wait_ms, max_queue=args.max_queue, timeout=args.timeout,
                    code_budget=args.code_budget, max_body_bytes=args.max_body_bytes,
                    max_new_tokens=args.max_new_tokens, exact=args.exact,
                    name=args.served_model_name or args.model, builtin_interventions=not args.no_builtins,
                    isolation=isolation, prompt_tokens_details=args.enable_prompt_tokens_details)
    for path in args.interventions:
        load_interventions(server, path)
    from ..openai.model_names import install_from_options
    install_from_options(server, args.edit, args.lora_modules)   # after the interventions edits may name
    from ..jobs.durable.options import attach as attach_kept_jobs
    attach_kept_jobs(server, args)     # --state-dir / --database: jobs kept in a store (docs/jobs.md)
    if server.supervised:   # fork the workers now: after the interventions are registered, before any request
        server.batcher.start()
    if not keys:
        log.warning("no API key configured: anyone who can reach %s:%s can use the model", args.host, args.port,
                    extra={"fields": {"event": "startup"}})
    if args.allow_code:
        log.warning("submitted code is enabled: best-effort sandbox, trusted users only (docs/serving.md)",
                    extra={"fields": {"event": "startup"}})
    return server


def choose_isolation(args, model, log):
    """``"thread"`` or a ``ProcessIsolation`` for the CLI's ``--isolation`` (``auto``: process with --allow-code)."""
    if args.isolation == "thread" or (args.isolation == "auto" and not args.allow_code):
        return "thread"
    from ..workers.supervisor import ProcessIsolation, check_forkable
    try:
        check_forkable(model)
    except ValueError as exc:
        if args.isolation == "process":
            raise
        log.warning("submitted code runs in this process (no worker isolation): %s", exc,
                    extra={"fields": {"event": "startup"}})
        return "thread"
    return ProcessIsolation(hang_timeout=args.hang_timeout,
                            memory_limit=(args.worker_memory_mb << 20) if args.worker_memory_mb > 0 else None)


def serve_one(args) -> int:
    """One server in this process over the model the options ask for (closing a vLLM engine at the end)."""
    prepare_process(args)
    keys = api_keys(args)
    log = logging.getLogger("asyncinterp.serve")
    model = build_model(args)
    try:
        return serve_forever(args, model, keys, log)
    finally:
        close = getattr(model, "close", None)   # a vLLM engine: shut it (and its workers) down
        if close is not None:
            close()
