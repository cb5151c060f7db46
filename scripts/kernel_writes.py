"""Report writes to a kernel's or a task's fields from outside src/asyncinterp/kernel/.

The kernel owns its state (issue 20): other layers read the fields of a
``Kernel`` or a ``Task`` but change them only through their methods. This
finds, with ``ast``, in every module outside the kernel package:

* ``X.f = ...``, ``X.f += ...``, ``del X.f``, and the same on ``X.f[...]``;
* ``X.f.append(...)`` and the other mutating methods of lists, dicts and sets
  (also on ``X.f[...]``);
* ``setattr(X, "f", ...)``, ``object.__setattr__(X, "f", ...)``, ``delattr(X, "f")``;

where ``f`` is a field of ``Kernel`` or ``Task`` (their ``__slots__`` and
every attribute their methods assign on ``self``) and ``X`` is a kernel or a
task: a name or attribute ending in ``kernel`` or ``task`` (``kernel``,
``self.kernel``, ``run.kernel``, ``s.task``), or a name the same function
binds to one (``k = run.kernel``, ``t = current_task()``, ``for t in
kernel.tasks``). Prints each write and exits 1, or prints "no kernel or task
field written outside the kernel" and exits 0. Files given as arguments are
scanned instead of the package.
"""

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "asyncinterp"
KERNEL = PACKAGE / "kernel"

#: classes whose fields only the kernel writes, and the modules that define them
OWNED = {"Kernel": "scheduler.py", "Task": "task.py"}
#: methods that change a list, dict or set in place
MUTATORS = frozenset((
    "append", "extend", "insert", "remove", "pop", "clear", "add", "discard", "update", "setdefault",
    "popitem", "sort", "reverse", "difference_update", "intersection_update", "symmetric_difference_update",
))
#: calls that return a kernel or a task
SOURCES = frozenset(("current_kernel", "current_task", "running_task", "Kernel", "Task"))
#: attributes holding tasks, iterated as ``for t in kernel.tasks``
TASK_COLLECTIONS = ("tasks", "step_waiters", "joiners")


def owned_fields(kernel_dir: pathlib.Path = KERNEL) -> dict:
    """Field name -> the owning classes' names, from ``__slots__`` and ``self.<name> = ...`` in their methods."""
    fields = {}
    for cls_name, module in OWNED.items():
        tree = ast.parse((kernel_dir / module).read_text())
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
        names = set()
        for node in ast.walk(cls):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                                    for t in node.targets):
                names.update(e.value for e in ast.walk(node.value)
                             if isinstance(e, ast.Constant) and isinstance(e.value, str))
            for target in _targets(node):
                for t in _flatten(target):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        names.add(t.attr)
        names.discard("__weakref__")
        for name in names:
            fields.setdefault(name, []).append(cls_name)
    return fields


def _targets(node):
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    if isinstance(node, ast.Delete):
        return node.targets
    return []


def _flatten(target):
    if isinstance(target, (ast.Tuple, ast.List)):
        for elt in target.elts:
            yield from _flatten(elt)
    elif isinstance(target, ast.Starred):
        yield from _flatten(target.value)
    else:
        yield target


def _last_name(expr):
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        return expr.attr
    return None


def _named_like(expr) -> bool:
    name = _last_name(expr)
    return name is not None and name.lower().endswith(("kernel", "task"))


class _Scope:
    """The names one function (or the module's top level) binds to kernels and tasks."""

    def __init__(self, node, outer=frozenset()):
        self.names = set(outer)
        changed = True
        while changed:   # `k = kernel` then `j = k`: until no new name
            before = len(self.names)
            for sub in ast.walk(node):
                self._bind(sub)
            changed = len(self.names) != before

    def is_owned(self, expr) -> bool:
        return _named_like(expr) or (isinstance(expr, ast.Name) and expr.id in self.names)

    def _produces(self, value) -> bool:
        if self.is_owned(value):
            return True
        if isinstance(value, ast.Call):
            func = value.func
            if _last_name(func) in SOURCES:
                return True
            if isinstance(func, ast.Attribute) and func.attr == "spawn" and self.is_owned(func.value):
                return True
            if (isinstance(func, ast.Name) and func.id == "getattr" and len(value.args) >= 2
                    and isinstance(value.args[1], ast.Constant) and str(value.args[1].value).endswith(("kernel", "task"))):
                return True
        return False

    def _holds_tasks(self, iterable) -> bool:
        if isinstance(iterable, ast.Call) and iterable.args and _last_name(iterable.func) in ("list", "sorted",
                                                                                            "reversed", "tuple"):
            iterable = iterable.args[0]
        name = _last_name(iterable)
        return name is not None and name.endswith(TASK_COLLECTIONS)

    def _bind(self, node):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                self._bind_pair(target, node.value)
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            self._bind_pair(node.target, node.value)
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)) and self._holds_tasks(node.iter):
            for t in _flatten(node.target):
                if isinstance(t, ast.Name):
                    self.names.add(t.id)

    def _bind_pair(self, target, value):
        if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)) \
                and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts):
                self._bind_pair(t, v)
        elif isinstance(target, ast.Name) and self._produces(value):
            self.names.add(target.id)


def writes(tree, fields: dict):
    """``(line, what, field)`` for every write to an owned field in ``tree``."""
    found = []

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, _Scope(child, scope.names))
                continue
            check(child, scope)
            visit(child, scope)

    def field_of(expr, scope):
        """``f`` when ``expr`` is ``X.f`` or ``X.f[...]`` with X a kernel or task and f an owned field, else None."""
        while isinstance(expr, ast.Subscript):
            expr = expr.value
        if isinstance(expr, ast.Attribute) and expr.attr in fields and scope.is_owned(expr.value):
            return expr.attr
        return None

    def check(node, scope):
        for target in _targets(node):
            for t in _flatten(target):
                field = field_of(t, scope) if isinstance(t, (ast.Attribute, ast.Subscript)) else None
                if field is not None:
                    verb = "deletes" if isinstance(node, ast.Delete) else "assigns"
                    found.append((node.lineno, f"{verb} {ast.unparse(t)}", field))
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in MUTATORS:
                field = field_of(func.value, scope)
                if field is not None:
                    found.append((node.lineno, f"calls {ast.unparse(func)}(...)", field))
            name = ast.unparse(func)
            if name in ("setattr", "delattr", "object.__setattr__", "object.__delattr__") and len(node.args) >= 2:
                obj, attr = node.args[0], node.args[1]
                if isinstance(attr, ast.Constant) and attr.value in fields and scope.is_owned(obj):
                    found.append((node.lineno, f"calls {name}({ast.unparse(obj)}, {attr.value!r}, ...)", attr.value))

    visit(tree, _Scope(tree))
    return sorted(found)


def main(argv) -> int:
    fields = owned_fields()
    paths = [pathlib.Path(a) for a in argv] or [p for p in sorted(PACKAGE.rglob("*.py"))
                                                if KERNEL not in p.parents]
    total = 0
    for path in paths:
        for line, what, field in writes(ast.parse(path.read_text(), str(path)), fields):
            owner = " or ".join(fields[field])
            print(f"{path}:{line}: {what}: {field} is a field of {owner}, which only the kernel writes; "
                  "call a method of the kernel or task instead")
            total += 1
    if total:
        print(f"{total} write(s) to kernel or task fields outside the kernel")
        return 1
    print("no kernel or task field written outside the kernel")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
