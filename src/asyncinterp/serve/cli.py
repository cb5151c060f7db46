"""``asyncinterp serve [MODEL]``: serve a model over HTTP on a loopback address.

    asyncinterp serve                          # bundled SmolLM2-135M-Instruct on 127.0.0.1:8000
    asyncinterp serve tiny-gpt2 --port 8123 --api-key secret --allow-code
    asyncinterp serve ./my-model-dir --interventions my_interventions.py
    asyncinterp serve ./my-model-dir --engine vllm --tensor-parallel-size 2 --max-model-len 2048
    asyncinterp serve ./my-model-dir --tensor-parallel-size 2      # transformers' TP plan, 2 ranks (gloo)

MODEL is ``smollm2`` (default), ``tiny-gpt2`` / ``tiny-llama`` (random
weights, instant), ``gpt2-small`` (GPT-2-small shape from config, random
weights) or a local transformers causal-LM directory. ``--engine vllm``
serves the model with an in-process vLLM engine (``ai.VLLM``; MODEL is then
``smollm2`` or a model directory) behind the same endpoints, native and
OpenAI-compatible. ``--interventions FILE`` loads a Python file that defines
``register(server)`` (your trusted named interventions). ``--edit
NAME=FILE.py:FUNCTION`` (or ``NAME=INTERVENTION:k=v,...``) installs a named
edit that requests choose by model name (``MODEL:NAME``). API keys come from
``--api-key`` (repeatable) or the ``ASYNCINTERP_API_KEYS`` environment
variable (comma separated).
"""

from __future__ import annotations

import argparse
import sys

from .http import startup
# names that lived here before the command was split from what every serving process does (issue 30)
from .http.startup import (api_keys, build_model, choose_isolation, configure, engine_options,  # noqa: F401
                           gpt2_small, load_interventions, load_model, load_vllm, make_server, prepare_process,
                           setup_logging)

__all__ = ["add_parser", "configure", "main", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand to an argparse ``subparsers`` (sets ``func``)."""
    p = subparsers.add_parser(
        "serve", help="serve a model over HTTP: coalesced interventions, msgpack wire format",
        description="Serve a model over HTTP (Starlette + uvicorn). Concurrent requests, each with its own "
                    "intervention, are coalesced into shared forward passes. See docs/serving.md.")
    _configure_all(p)
    p.set_defaults(func=run)
    return p


def _configure_all(p: argparse.ArgumentParser) -> None:
    startup.configure(p)
    from .scale.replicas import add_arguments   # --replicas and the Ray options (Ray itself is imported on use)
    add_arguments(p)


def run(args) -> int:
    """``asyncinterp serve``: N replicas on Ray Serve, a tensor-parallel model's ranks, or one server here."""
    from .http.reach import is_loopback
    if not is_loopback(args.host) and not args.allow_non_loopback:
        print(f"asyncinterp serve: refusing to bind {args.host!r}: only loopback addresses (127.0.0.1, ::1, "
              "localhost) unless --allow-non-loopback", file=sys.stderr)
        return 2
    if getattr(args, "replicas", None) is not None:
        from .scale.replicas import run_replicated
        try:
            return run_replicated(args)
        except (FileNotFoundError, ValueError) as exc:
            print(f"asyncinterp serve: error: {exc}", file=sys.stderr)
            return 1
    startup.engine_options(args)   # refuse inconsistent engine options before loading anything
    if args.engine == "transformers" and (args.tensor_parallel_size or 1) > 1:
        startup.prepare_process(args)
        from .scale.tp_serve import launch_ranks   # the ranks load and serve the model; this process waits
        return launch_ranks(args)
    return startup.serve_one(args)


def main(argv=None) -> int:
    """Entry point usable on its own: ``python -m asyncinterp.serve.cli [MODEL] ...``."""
    p = argparse.ArgumentParser(prog="asyncinterp serve", description=__doc__.split("\n\n")[0])
    _configure_all(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130
    except (FileNotFoundError, ValueError) as exc:
        print(f"asyncinterp serve: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
