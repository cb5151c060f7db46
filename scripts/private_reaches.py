"""Count reaches into other objects' private state (issue 11's metric).

An attribute with one leading underscore read or written on anything but
``self``/``cls``, plus every ``__dict__`` use. Prints per-file counts and the
total; ``-v`` lists each reach.
"""

import ast
import pathlib
import sys


def reaches(path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            a = node.attr
            if a == "__dict__":
                yield node.lineno, a
            elif a.startswith("_") and not a.startswith("__"):
                v = node.value
                if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                    continue
                yield node.lineno, a


def main(argv):
    verbose = "-v" in argv
    root = pathlib.Path(__file__).resolve().parent.parent / "src" / "asyncinterp"
    total = 0
    rows = []
    for p in sorted(root.rglob("*.py")):
        found = list(reaches(p))
        if found:
            rows.append((len(found), p.relative_to(root), found))
            total += len(found)
    for n, p, found in sorted(rows, key=lambda r: -r[0]):
        print(f"{n:4d} {p}")
        if verbose:
            for line, a in found:
                print(f"       {line}: {a}")
    print(f"{total:4d} total")


if __name__ == "__main__":
    main(sys.argv[1:])
