"""The static check of submitted source: refused before any model work, naming the line.

:func:`check_source` parses the source and refuses (:class:`SandboxRefused`,
HTTP 400) what :mod:`asyncinterp.client.policy` does not allow: imports outside its modules,
private, refused or unlisted names, torch operations it leaves out, refused
builtins and syntax, attribute assignments other than hook points, code at
the top level, and sources over its size limits. Attribute names outside the
allow-list that may be names of the model pass here; the instrumented code
checks them where they are read (see :mod:`.instrumentation`).
"""

from __future__ import annotations

import ast
import threading

from ...client import policy
from .errors import SandboxRefused
from .operations import STATIC_DENIED_OPS

#: CPython 3.11 and 3.12 count the depth of their AST conversions in one counter per interpreter, not per
#: thread, so two threads parsing or compiling at once can fail with "AST constructor recursion depth
#: mismatch" (CPython gh-106905): submitted code is parsed and compiled holding this lock (the event loop
#: checks small jobs while worker threads load sessions and large jobs).
AST_LOCK = threading.RLock()


def _where(node) -> str:
    return f"line {getattr(node, 'lineno', '?')}"


class _Checker(ast.NodeVisitor):
    def __init__(self):
        self.nodes = 0
        self.depth = 0
        self.allowed_stores = set()

    def generic_visit(self, node):
        self.nodes += 1
        if self.nodes > policy.MAX_AST_NODES:
            raise SandboxRefused(f"submitted code is too large (more than {policy.MAX_AST_NODES} syntax nodes)")
        refused = policy.REFUSED_SYNTAX.get(type(node).__name__)
        if refused:
            raise SandboxRefused(f"{refused} are not allowed in submitted code ({_where(node)})")
        self.depth += 1
        if self.depth > policy.MAX_NESTING:
            raise SandboxRefused(f"submitted code is nested too deeply at {_where(node)}")
        try:
            super().generic_visit(node)
        finally:
            self.depth -= 1

    def visit_Import(self, node):
        for alias in node.names:
            _check_module(alias.name, node)
            if alias.asname:
                _check_name(alias.asname, node)
        self.generic_visit(node)

    def visit_ImportFrom(self, node):
        if node.level:
            raise SandboxRefused(f"relative imports are not allowed ({_where(node)})")
        _check_module(node.module or "", node)
        for alias in node.names:
            if alias.name == "*":
                raise SandboxRefused(f"`from {node.module} import *` is not allowed ({_where(node)})")
            check_attribute(alias.name, node)
            if alias.name not in policy.ALLOWED_ATTRIBUTES:
                raise SandboxRefused(
                    f"{alias.name!r} cannot be imported from {node.module} in submitted code ({_where(node)}): it "
                    "is not on the allow-list (asyncinterp/client/policy.py)")
            if alias.asname:
                _check_name(alias.asname, node)
        self.generic_visit(node)

    def visit_Attribute(self, node):
        check_attribute(node.attr, node)
        if not isinstance(node.ctx, ast.Load) and id(node) not in self.allowed_stores:
            raise SandboxRefused(
                f"assigning or deleting attribute {node.attr!r} is not allowed in submitted code ({_where(node)}); "
                "only hook points can be assigned (`m.layer.output = value`, as a single assignment)")
        self.generic_visit(node)

    def visit_Assign(self, node):
        if len(node.targets) == 1 and isinstance(node.targets[0], ast.Attribute) \
                and node.targets[0].attr in policy.ASSIGNABLE_POINTS:
            self.allowed_stores.add(id(node.targets[0]))
        self.generic_visit(node)

    def visit_Name(self, node):
        _check_name(node.id, node)
        self.generic_visit(node)

    def visit_FunctionDef(self, node):
        _check_name(node.name, node)
        self._args(node.args)
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node):
        self._args(node.args)
        self.generic_visit(node)

    def visit_ExceptHandler(self, node):
        if node.name:
            _check_name(node.name, node)
        self.generic_visit(node)

    def visit_keyword(self, node):
        if node.arg is not None:
            _check_name(node.arg, node)
        self.generic_visit(node)

    def _args(self, args):
        for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]:
            if a is not None:
                _check_name(a.arg, a)


def _check_module(name: str, node) -> None:
    if name not in policy.ALLOWED_MODULES:
        raise SandboxRefused(
            f"import of {name!r} is not allowed in submitted code ({_where(node)}); allowed modules: "
            f"{', '.join(policy.ALLOWED_MODULES)}. Submitted code has no file, network or process access.")


def check_attribute(attr: str, node) -> None:
    """Refuse attribute name ``attr`` now unless the policy allows it, or it may be a name of the model
    (then the instrumented code checks, where it is read, that it is read from the model)."""
    if attr.startswith(policy.PRIVATE_ATTRIBUTE):
        raise SandboxRefused(f"attribute {attr!r} is not allowed in submitted code ({_where(node)}): names "
                             "starting with an underscore are private")
    if attr in policy.REFUSED_ATTRIBUTES:
        raise SandboxRefused(f"attribute {attr!r} is not allowed in submitted code ({_where(node)})")
    if attr in policy.ALLOWED_ATTRIBUTES:
        return
    if attr in STATIC_DENIED_OPS:
        raise SandboxRefused(f"operation {attr!r} is not available to submitted code ({_where(node)}): it is not "
                             "on the allow-list (tensor math, indexing, reductions, shape operations, zero-filled "
                             "creation)")


def _check_name(name: str, node) -> None:
    if name.startswith(policy.PRIVATE_NAME):
        raise SandboxRefused(f"name {name!r} is not allowed in submitted code ({_where(node)})")


def bound_names(tree) -> set:
    """Every name the source binds somewhere (parameters, assignments, imports, loops, defs)."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            bound.add(node.name)
        elif isinstance(node, ast.alias):
            bound.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return bound


def _check_refused_builtins(tree) -> None:
    bound = bound_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in policy.REFUSED_BUILTINS and node.id not in bound:
            raise SandboxRefused(f"{node.id!r} is not available in submitted code ({_where(node)}): "
                                 f"{policy.REFUSED_BUILTINS[node.id]}")


def _is_literal(node) -> bool:
    try:
        ast.literal_eval(node)
    except Exception:
        return False
    return True


def _check_top_level(tree) -> None:
    for stmt in tree.body:
        if type(stmt).__name__ not in policy.TOP_LEVEL_STATEMENTS or not _allowed_at_top_level(stmt):
            raise SandboxRefused(
                f"only imports, function definitions and literal constants are allowed at the top level of "
                f"submitted code ({_where(stmt)})")


def _allowed_at_top_level(stmt) -> bool:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if stmt.decorator_list:
            raise SandboxRefused(f"decorators are not allowed on top-level functions ({_where(stmt)})")
        for d in stmt.args.defaults + [d for d in stmt.args.kw_defaults if d is not None]:
            if not _is_literal(d):
                raise SandboxRefused(f"default values of top-level functions must be literals ({_where(d)})")
        if stmt.returns is not None or any(a.annotation is not None for a in ast.walk(stmt.args)
                                           if isinstance(a, ast.arg)):
            _strip_annotations(stmt)
        return True
    if isinstance(stmt, ast.Expr):
        return isinstance(stmt.value, ast.Constant)     # a docstring
    if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
        return stmt.value is not None and _is_literal(stmt.value)
    return isinstance(stmt, (ast.Import, ast.ImportFrom))


def _strip_annotations(fn) -> None:
    """Annotations are evaluated at definition time; drop them (they are documentation only)."""
    fn.returns = None
    for a in ast.walk(fn.args):
        if isinstance(a, ast.arg):
            a.annotation = None


def check_source(source: str) -> ast.Module:
    """Parse and check submitted source; raise :class:`SandboxRefused` with the reason."""
    if not isinstance(source, str):
        raise SandboxRefused("source must be a string")
    if len(source) > policy.MAX_SOURCE_CHARS:
        raise SandboxRefused(f"submitted code is too long ({len(source)} > {policy.MAX_SOURCE_CHARS} characters)")
    if "\x00" in source:
        raise SandboxRefused("submitted code contains a NUL character")
    depth = 0
    for ch in source:  # cheap guard before the parser sees pathological nesting
        if ch in "([{":
            depth += 1
            if depth > policy.MAX_NESTING:
                raise SandboxRefused("submitted code is nested too deeply")
        elif ch in ")]}":
            depth -= 1
    try:
        with AST_LOCK:
            tree = ast.parse(source, mode="exec")
    except SyntaxError as exc:
        raise SandboxRefused(f"submitted code does not parse: {exc.msg} (line {exc.lineno})") from None
    except (ValueError, RecursionError, MemoryError) as exc:
        raise SandboxRefused(f"submitted code does not parse: {type(exc).__name__}") from None
    _Checker().visit(tree)
    _check_refused_builtins(tree)
    _check_top_level(tree)
    return tree
