"""The ``asyncinterp`` command line.

``asyncinterp demo`` runs the SmolLM2 demo (see :mod:`asyncinterp.demo`); ``asyncinterp harvest`` writes
activations over a dataset to disk (see :mod:`asyncinterp.harvesting.cli`).
Subcommands register themselves in :data:`COMMANDS`: each entry is a function
that adds a subparser to argparse's ``subparsers`` and sets ``func`` (called
with the parsed arguments, returns the exit code). Heavy imports happen
inside ``func`` so ``asyncinterp --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys


def _add_demo(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", help="causal tracing, logit lens and steering on SmolLM2-135M (offline)",
        description="Run activation patching (causal tracing), a logit lens and steering during generation "
                    "on the bundled SmolLM2-135M-Instruct; prints tables and saves a heatmap PNG.")
    p.add_argument("--out", default="asyncinterp-demo", metavar="DIR",
                   help="directory for causal_trace.png and causal_trace.csv (default: ./asyncinterp-demo)")
    p.add_argument("--model", default="smollm2", metavar="NAME_OR_PATH",
                   help="'smollm2' (default), 'tiny' / 'tiny-gpt2' (random weights, for a quick check), "
                        "or a local transformers causal-LM directory")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="where the converted SmolLM2 lives (default: $ASYNCINTERP_CACHE or ~/.cache/asyncinterp)")
    p.add_argument("--rebuild", action="store_true", help="convert SmolLM2 again even if a valid cache exists")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")

    def run(args):
        from .demo import main
        return main(args)
    p.set_defaults(func=run)


def _add_serve(subparsers) -> None:
    # `asyncinterp serve`: defined in asyncinterp.serve.cli (needs the `serve` extra only when run); with
    # --replicas N the same server runs as N replicas on Ray Serve (asyncinterp.serve.scale.replicas, the `ray` extra)
    from .serve.cli import add_parser
    add_parser(subparsers)


def _add_harvest(subparsers) -> None:
    # `asyncinterp harvest`: activations over a dataset to disk (asyncinterp.harvesting.cli, docs/harvest.md)
    from .harvesting.cli import add_parser
    add_parser(subparsers)


# Subcommands: functions that add a parser to `subparsers` and set `func`.
COMMANDS = [_add_demo, _add_serve, _add_harvest]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncinterp",
        description="asyncinterp: read and change activations inside PyTorch models with plain async coroutines.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in COMMANDS:
        add(subparsers)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a clear one-line error for known failures (missing model package, bad path)
        from .models.hf.bundled import BundledModelError
        if isinstance(exc, (BundledModelError, FileNotFoundError)):
            print(f"asyncinterp {args.command}: error: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
