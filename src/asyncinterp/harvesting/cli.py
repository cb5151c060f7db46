"""``asyncinterp harvest MODEL --dataset ... --points ... --out DIR``: a harvest from the command line.

Why this module exists: a harvest is a long batch job; a command (rerun with
the same arguments after a crash to resume) is how it is started on a
machine, and later submitted as a remote job. The options are
``ai.harvest``'s; MODEL is ``smollm2`` (the bundled SmolLM2-135M), ``tiny``
(random weights, a quick check) or a local transformers model directory.
"""

from __future__ import annotations

import sys

__all__ = ["add_parser"]


def add_parser(subparsers):
    p = subparsers.add_parser(
        "harvest", help="activations of a model over a dataset, into a resumable datasets directory",
        description="Run MODEL over a dataset in fixed windows and write the activations of the given points "
                    "as a datasets directory that SAELens reads (use_cached_activations). Rerun the same command "
                    "after an interruption to resume. See docs/harvest.md.")
    p.add_argument("model", metavar="MODEL", help="'smollm2', 'tiny', or a local transformers model directory")
    p.add_argument("--dataset", required=True, metavar="PATH",
                   help="JSONL / Parquet / Arrow file(s) (comma-separated or a glob) or a save_to_disk directory")
    p.add_argument("--points", required=True, metavar="NAMES",
                   help="comma-separated point names, e.g. blocks.6.hook_resid_post,layers.3.attn.z")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory or fsspec URL")
    p.add_argument("--engine", choices=("transformers", "vllm"), default="transformers")
    p.add_argument("--column", default=None, help="the text or token-id column (default: text / input_ids)")
    p.add_argument("--split", default="train", help="split of a DatasetDict directory (default: train)")
    p.add_argument("--context-size", type=int, default=128)
    p.add_argument("--no-prepend-bos", action="store_true", help="windows do not start with the BOS token")
    p.add_argument("--separator", default="bos", help="token between packed documents: bos, eos, sep, an id, "
                                                      "or none")
    p.add_argument("--packing", choices=("concat", "truncate"), default="concat")
    p.add_argument("--positions", default="all", help="all, last, or start:stop (e.g. 1: to drop BOS)")
    p.add_argument("--dtype", default="float32", help="storage dtype: fp32, fp16 or bf16")
    p.add_argument("--model-dtype", default="float32", help="dtype the model runs in (default float32)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--shard-windows", type=int, default=None, help="windows per shard (default: from --buffer-mb)")
    p.add_argument("--buffer-mb", type=float, default=256, help="memory for one shard's values (default 256)")
    p.add_argument("--max-windows", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--no-progress", action="store_true")
    g = p.add_argument_group("past one machine (Ray Data; docs/harvest.md)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="compute the shards on engine actors of this Ray cluster ('auto', host:port, ray://...; "
                        "'local': a new local Ray); the output directory must be one every node sees")
    g.add_argument("--ray-actors", type=int, default=2, metavar="N", help="engine actors (default 2)")
    g.add_argument("--ray-cpus", type=float, default=1, metavar="N", help="CPUs per actor (default 1)")
    p.set_defaults(func=run)
    return p


def _load(args):
    import torch
    dtype = getattr(torch, {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(args.model_dtype,
                                                                                         args.model_dtype))
    if args.engine == "vllm":
        from ..models.vllm import VLLM
        path = args.model
        if path == "smollm2":
            from ..models.hf.bundled import smollm2_dir
            path = str(smollm2_dir())
        return VLLM(path, dtype=str(dtype).replace("torch.", ""), max_model_len=max(args.context_size + 8, 64))
    if args.model == "smollm2":
        from ..models import smollm2
        return smollm2()
    if args.model == "tiny":
        from ..models import tiny
        return tiny("llama")
    from ..models.hf.language import LanguageModel
    return LanguageModel.from_pretrained(args.model, dtype=dtype)


def _ray_options(args):
    """``--ray-address``: each actor loads MODEL as this command does (not shipped from here)."""
    if args.ray_address is None:
        return None
    import functools

    from .on_ray import RayOptions
    return RayOptions(address=None if args.ray_address == "local" else args.ray_address, actors=args.ray_actors,
                      num_cpus=args.ray_cpus, model=functools.partial(_load, args))


def run(args) -> int:
    from . import harvest
    dataset = args.dataset.split(",") if "," in args.dataset else args.dataset
    separator = args.separator
    if separator.lower() == "none":
        separator = None
    elif separator.isdigit():
        separator = int(separator)
    from .store import ManifestMismatch
    model = _load(args)
    try:
        result = harvest(model, dataset, [p.strip() for p in args.points.split(",") if p.strip()], args.out,
                         column=args.column, split=args.split, context_size=args.context_size,
                         prepend_bos=not args.no_prepend_bos, separator=separator, packing=args.packing,
                         positions=args.positions, dtype=args.dtype, batch_size=args.batch_size,
                         shard_windows=args.shard_windows, buffer_mb=args.buffer_mb, max_windows=args.max_windows,
                         max_tokens=args.max_tokens, progress=not args.no_progress, ray=_ray_options(args))
    except ManifestMismatch as exc:
        print(f"asyncinterp harvest: error: {exc}", file=sys.stderr)
        return 1
    finally:
        close = getattr(model, "close", None)
        if close is not None:
            close()
    print(f"harvest: {result.windows} windows ({result.tokens} tokens) in {result.shards} shard(s) at {result.path}; "
          f"{result.resumed_shards} shard(s) were already complete; {result.tokens_per_second:,.0f} tok/s")
    return 0
