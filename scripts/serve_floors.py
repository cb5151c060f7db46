"""Check that imports between the floors of serving run only downward, and that the client loads no server module.

The floors, top to bottom (docs/design.md draws them)::

    asyncinterp.serve (the package and its command, cli.py)
    asyncinterp.serve.scale        replicas on Ray Serve, tensor-parallel ranks and their front
    asyncinterp.serve.http         the app and its routes, metrics, capabilities, process start
    asyncinterp.serve.openai       OpenAI / vLLM server compatibility
    asyncinterp.serve.workers      process isolation: supervisor, pool, worker processes
    asyncinterp.serve.jobs         submitted jobs and sessions: read, check, run once; the error table
    asyncinterp.serve.sandbox      submitted code: checked, restricted, instrumented
    asyncinterp.serve.scheduling   the serving front, what a request is, engine differences
    asyncinterp.client             ai.remote, the HTTP clients, the job's wire format, the sandbox policy

A module may import its own floor and the floors below it. Nothing outside
these floors (the core library: kernel, hooks, models, tools) imports any of
them, except the command line and the package's lazy ``ai.remote``/``ai.serve``.
Prints each wrong edge and exits 1, or prints "floors hold" and exits 0.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from import_cycles import graph  # noqa: E402

FLOORS = ["asyncinterp.serve", "asyncinterp.serve.scale", "asyncinterp.serve.http", "asyncinterp.serve.openai",
          "asyncinterp.serve.workers", "asyncinterp.serve.jobs", "asyncinterp.serve.sandbox",
          "asyncinterp.serve.scheduling", "asyncinterp.client"]
# core modules allowed to reach up into serving: the command line and the package's lazy attributes
ENTRY_POINTS = {"asyncinterp", "asyncinterp.cli"}


def floor_of(module: str):
    """The index of ``module``'s floor in :data:`FLOORS` (the deepest floor whose name prefixes it), else None."""
    best = None
    for i, floor in enumerate(FLOORS):
        if module == floor or module.startswith(floor + "."):
            if best is None or len(floor) > len(FLOORS[best]):
                best = i
    return best


def wrong_edges(edges: dict) -> list:
    out = []
    for source, targets in sorted(edges.items()):
        here = floor_of(source)
        for target, line in sorted(targets.items()):
            there = floor_of(target)
            if there is None:
                continue
            if here is None:
                if source not in ENTRY_POINTS:
                    out.append((source, line, target, "the core library imports serving"))
            elif there < here:
                out.append((source, line, target, f"{FLOORS[here]} imports the floor above it, {FLOORS[there]}"))
    return out


def main(argv) -> int:
    root = pathlib.Path(argv[1]) if len(argv) > 1 else pathlib.Path(__file__).resolve().parent.parent / "src" / "asyncinterp"
    bad = wrong_edges(graph(root))
    for source, line, target, why in bad:
        print(f"{source}:{line} imports {target}: {why}")
    if bad:
        return 1
    print("floors hold")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
