"""Module names checked on the client, against the served model's tree, before a remote job is sent.

A typo in ``m.model.layers[3].mlpp.output`` should fail on your machine,
with a suggestion, not after a round trip. :func:`check_names` reads an
intervention's source (the chains of attributes and constant indices that
start at its first parameter, the model) and walks each chain down the
module tree the server published (``GET /v1/model``: ``[[path, type], ...]``).
A step that is not a submodule must be a name the server's view of the
model answers (a hook point, a standard alias or semantic point, ``steps``,
``stop``...); otherwise it is a
:class:`~asyncinterp.kernel.errors.ModulePathError` naming the path and the
closest submodule names. A chain is checked only as far as it is known:
after a hook point, an alias or an index that is not a constant, the rest
is left to the server. Helpers the intervention calls are not checked
(their parameters need not be the model).
"""

from __future__ import annotations

import ast
import difflib
import functools

from ..hooks.aliases import STANDARD
from ..hooks.envoy import SEMANTIC_NAMES, Envoy, point
from ..hooks.tl_names import NAMES as TL_NAMES
from ..kernel.errors import ModulePathError
from ..lru import LRU
from . import policy
from .sources import parsed_source

__all__ = ["ModuleTree", "check_names"]


def _point_names() -> frozenset:
    classes = [Envoy]
    try:
        from ..models.hf.language import LanguageModel
        classes.append(LanguageModel)
    except ImportError:  # pragma: no cover - no transformers on this client
        pass
    names = {n for cls in classes for k in cls.__mro__ for n, v in vars(k).items() if isinstance(v, point)}
    return frozenset(names | {"grad", "logits", "tokens"})


class ModuleTree:
    """The served model's module paths (``"transformer.h.0.mlp"``), as children by parent path."""

    def __init__(self, modules):
        self.children = {"": []}
        for entry in modules:
            path = entry[0] if isinstance(entry, (list, tuple)) else entry
            parent, _, name = str(path).rpartition(".")
            self.children.setdefault(parent, []).append(name)
            self.children.setdefault(str(path), [])
        self.known = _point_names() | SEMANTIC_NAMES | TL_NAMES | set(STANDARD) | policy.ENVOY_ATTRIBUTES
        self.root_known = policy.ROOT_ATTRIBUTES | {"backward"}

    def walk(self, steps, fn_name, line):
        """Follow one chain of ``("attr", name)`` / ``("index", int | None)`` steps from the root."""
        here = ""
        for kind, value in steps:
            children = self.children.get(here, [])
            if kind == "index":
                if value is None or not children or not all(c.isdigit() for c in children):
                    return
                i = value + len(children) if value < 0 else value
                if not 0 <= i < len(children):
                    raise ModulePathError(f"{fn_name} (line {line}): {here or 'the model'} has {len(children)} "
                                          f"modules; index {value} is out of range")
                here = f"{here}.{i}" if here else str(i)
                continue
            if value in children:
                here = f"{here}.{value}" if here else value
                continue
            if value in self.known or (here == "" and value in self.root_known):
                return
            close = difflib.get_close_matches(value, children + sorted(self.known), n=3, cutoff=0.5)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            listing = ", ".join(children[:12]) + (" ..." if len(children) > 12 else "")
            raise ModulePathError(
                f"{fn_name} (line {line}): {here or 'the served model'} has no submodule or hook point {value!r}."
                f"{hint} Its submodules are: {listing or '(none)'} (checked against the server's model, "
                "GET /v1/model)")


def check_names(fn, tree: ModuleTree) -> None:
    """Raise ``ModulePathError`` if ``fn`` (an intervention) names a module the served model does not have."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    code = getattr(fn, "__code__", None)
    if code is None or code.co_argcount < 1:
        return
    chains = _CHAINS.get(code)
    if chains is None:     # read once per code object; only the values of named indices are read each time
        try:
            chains = _CHAINS.put(code, _chains(fn))
        except (OSError, TypeError, SyntaxError):
            return   # capture reports what it cannot read
    values = _constants(fn) if any(kind == "var" for steps, _ in chains for kind, _ in steps) else {}
    first = code.co_firstlineno
    for steps, line in chains:
        tree.walk([("index", values.get(v)) if kind == "var" else (kind, v) for kind, v in steps],
                  fn.__qualname__, first + line - 1)


def _chains(fn) -> tuple:
    """The chains of attributes and indices ``fn``'s source takes from its first parameter, with their lines:
    steps ``("attr", name)``, ``("index", int or None)`` or ``("var", name)`` (an index read from a global or a
    closure cell, resolved when checked)."""
    _, tree_ = parsed_source(fn)
    node = tree_.body[0] if tree_.body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.args.args:
        return ()
    model = node.args.args[0].arg
    out = []
    for sub in ast.walk(node):
        steps = _chain(sub, model)
        if steps:
            out.append((tuple(steps), getattr(sub, "lineno", 1)))
    return tuple(out)


_CHAINS = LRU(256)    # code object -> its chains (_chains)


def _constants(fn) -> dict:
    """Integers ``fn`` reads from globals and closure cells (``m.layers[LAYER]``)."""
    out = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            if type(cell.cell_contents) is int:
                out[name] = cell.cell_contents
        except ValueError:
            pass
    for name in fn.__code__.co_names:
        value = fn.__globals__.get(name)
        if type(value) is int:
            out.setdefault(name, value)
    return out


def _chain(node, model):
    """The steps of a maximal attribute/subscript chain rooted at the name ``model``, or ``None``."""
    steps = []
    while True:
        if isinstance(node, ast.Attribute):
            steps.append(("attr", node.attr))
            node = node.value
        elif isinstance(node, ast.Subscript):
            steps.append(_index(node.slice))
            node = node.value
        else:
            break
    if not isinstance(node, ast.Name) or node.id != model or not steps:
        return None
    return steps[::-1]


def _index(node):
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return "index", node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
            and type(node.operand.value) is int:
        return "index", -node.operand.value
    if isinstance(node, ast.Name):
        return "var", node.id
    return "index", None
