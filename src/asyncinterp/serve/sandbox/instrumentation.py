"""Instrumentation of checked source: the hooks that run inside submitted code.

The checked syntax tree is rewritten before it is compiled, so that:

* every loop body, function body, lambda and comprehension calls the tick
  (``__ai_tick__``: the request's clock, which raises
  :class:`~.errors.SandboxTimeout` when its time is up);
* every read of an attribute name outside ``policy.ALLOWED_ATTRIBUTES``
  goes through ``__ai_member__`` (:func:`~.namespace.read_unlisted`), which
  lets only the model's envoys and hook points answer it;
* ``x.point = value`` goes through ``__ai_setpoint__`` (hook points of the
  model only);
* text made from a value (f-strings, ``%``, ``str(x)``) goes through
  ``__ai_plain__``, which refuses values whose text shows an address.

The ``__ai_*`` names cannot be written in submitted source (names starting
with ``__`` are refused), so only the rewriting reaches them.
"""

from __future__ import annotations

import ast

from ...client import policy
from .checker import bound_names

TICK = "__ai_tick__"
SETPOINT = "__ai_setpoint__"
PLAIN = "__ai_plain__"
MEMBER = "__ai_member__"


def _call(name, *args):
    return ast.Call(func=ast.Name(id=name, ctx=ast.Load()), args=list(args), keywords=[])


class _Instrument(ast.NodeTransformer):
    def __init__(self, bound):
        self.bound = bound

    def _body(self, node):
        self.generic_visit(node)
        node.body.insert(0, ast.Expr(value=_call(TICK)))
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = _body
    visit_For = visit_AsyncFor = visit_While = _body

    def visit_Lambda(self, node):
        self.generic_visit(node)
        node.body = ast.BoolOp(op=ast.And(), values=[_call(TICK), node.body])
        return node

    def visit_Attribute(self, node):
        self.generic_visit(node)
        if isinstance(node.ctx, ast.Load) and node.attr not in policy.ALLOWED_ATTRIBUTES:
            return ast.copy_location(_call(MEMBER, node.value, ast.Constant(node.attr)), node)
        return node

    def visit_Assign(self, node):
        self.generic_visit(node)
        target = node.targets[0]
        if len(node.targets) == 1 and isinstance(target, ast.Attribute):
            # the base of a store target is already a Load expression
            call = _call(SETPOINT, target.value, ast.Constant(target.attr), node.value)
            return ast.copy_location(ast.Expr(value=call), node)
        return node

    def visit_FormattedValue(self, node):
        # f"{x}": the text of x must not show a memory address
        self.generic_visit(node)
        node.value = _call(PLAIN, node.value)
        return node

    def visit_BinOp(self, node):
        self.generic_visit(node)
        if isinstance(node.op, ast.Mod):   # "%s" % x
            node.right = _call(PLAIN, node.right)
        return node

    def visit_Call(self, node):
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id == "str" and node.args and "str" not in self.bound:
            node.args[0] = _call(PLAIN, node.args[0])
        return node

    def visit_comprehension(self, node):
        self.generic_visit(node)
        node.ifs.insert(0, _call(TICK))
        return node


def instrument(tree: ast.Module) -> ast.Module:
    """``tree`` (checked by :func:`~.checker.check_source`) with the hooks above put in."""
    tree = _Instrument(bound_names(tree)).visit(tree)
    return ast.fix_missing_locations(tree)
