"""Report import cycles between the modules of src/asyncinterp.

Builds the module import graph with ``ast``: every ``import``/``from ...
import`` of an asyncinterp module, relative or absolute, at module level or
inside a function (a deferred import still ties the two modules together),
or under ``if TYPE_CHECKING:`` (it never runs, but a type checker and a
reader follow it: a circle there is still a circle of the design).
``from pkg import name`` counts as an import of ``pkg.name`` when that is a
module, else of ``pkg`` itself. Prints each cycle (as a strongly connected
component and one path through it) and exits 1, or prints "no import
cycles" and exits 0. ``-v`` also lists every edge.
"""

import ast
import pathlib
import sys

PACKAGE = "asyncinterp"


def module_names(root: pathlib.Path) -> dict:
    """Dotted module name -> file, for every .py under ``root`` (the package directory)."""
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = list(p.relative_to(root.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (p, is_pkg)
    return out


def imports_of(name: str, path: pathlib.Path, is_pkg: bool, modules: dict):
    """The asyncinterp modules that module ``name`` imports (with line numbers)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if is_pkg else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name
                # `import a.b.c` imports a, a.b and a.b.c; the deepest known module is what it needs
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target:
                    yield node.lineno, target
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if node.level > 1:
                    base = base[: len(base) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base != PACKAGE and not base.startswith(PACKAGE + "."):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    yield node.lineno, sub
                elif base in modules:
                    yield node.lineno, base


def graph(root: pathlib.Path) -> dict:
    modules = module_names(root)
    edges = {}
    for name, (path, is_pkg) in modules.items():
        targets = {}
        for line, target in imports_of(name, path, is_pkg, modules):
            if target != name:
                targets.setdefault(target, line)
        edges[name] = targets
    return edges


def cycles(edges: dict) -> list:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def a_cycle(edges: dict, comp: list) -> list:
    """One closed path through the component ``comp`` (for the report)."""
    members = set(comp)
    start = comp[0]
    prev = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v]):
                if w not in members:
                    continue
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return list(reversed(path)) + [start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp  # pragma: no cover - a component always has a cycle through each member


def main(argv) -> int:
    root = pathlib.Path(__file__).resolve().parent.parent / "src" / PACKAGE
    edges = graph(root)
    if "-v" in argv:
        for v in sorted(edges):
            for w, line in sorted(edges[v].items()):
                print(f"{v}:{line} -> {w}")
    found = cycles(edges)
    if not found:
        print("no import cycles")
        return 0
    for comp in found:
        path = a_cycle(edges, comp)
        steps = " -> ".join(f"{v}" + (f" (line {edges[v][w]})" if w else "") for v, w in zip(path, path[1:] + [None]))
        print(f"cycle among {len(comp)} modules: {', '.join(comp)}")
        print(f"  e.g. {steps}")
    print(f"{len(found)} import cycle(s)")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
