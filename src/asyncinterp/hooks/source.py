"""Source-level hook points: the result of one call *inside* a module's ``forward``.

``m.model.layers[0].self_attn.source`` lists every call in the module's
``forward`` with a name and its line number::

    print(m.model.layers[0].self_attn.source)
    #  self_q_proj_0          262 |         query_states = self.q_proj(hidden_states).view(...)
    #  view_0                     |
    #  ...
    #  attention_interface_0  276 |         attn_output, attn_weights = attention_interface(

and each call is a hook point like a module's: ``await
attn.source.attention_interface_0.output`` returns what that call returned
(here ``(attn_output, attn_weights)``), ``.inputs`` its ``(args, kwargs)``;
both can be edited in place or replaced, per invoke, in every generation step.

One level deeper: ``op.source`` lists the calls inside the Python function
a call site calls (``attn.source.apply_rotary_pos_emb_0.source``), with hook
points of their own. A callee chosen at run time (Hugging Face attention:
``attention_interface = ...``) is known after a run that used the module's
source points, or is named explicitly:
``attn.source.attention_interface_0.source_of(eager_attention_forward)``;
its points fire only when that call site calls that function.

How it works. The first time a module class is asked for its source, its
``forward`` is re-compiled from ``inspect.getsource`` with every call
``f(a, b=c)`` rewritten to ``__ai_call__(i, f, a, b=c)`` (same evaluation
order; compiled with the original file name and line numbers, so tracebacks
and debuggers show the real source). Nothing is installed: a module whose
source points nobody awaits runs its original ``forward`` and pays nothing.
When a task awaits a source point, the run sets the rewritten ``forward`` on
that module instance only (``module.forward``), with an ``__ai_call__`` that
calls ``f`` and delivers the result to the kernel only for the calls some
task waits on; the run removes it when it ends, like its hooks. A nested
point makes that call site call a rewritten copy of its callee, for that run
only.

Naming: a call of an attribute of ``self`` or of a module (``self.q_proj``,
``torch.matmul``, ``nn.functional.softmax``) is named by the dotted path with
``_`` (``self_q_proj``, ``torch_matmul``); a method call on a value
(``x.view(...)``) by the method (``view``); a plain function by its name
(``apply_rotary_pos_emb``); then ``_0``, ``_1``... in source order.
``super()``, ``locals()`` and the like are not rewritten.

Limits: the forward must be a plain Python function whose source is
available (not a C extension, not defined in a REPL without source); a module
whose ``forward`` was replaced per instance (accelerate offloading wrappers)
is refused with a clear error. Awaiting a source point while its module is
already running applies from the module's next call; the await fails at once
as out of order instead of waiting.
"""

from __future__ import annotations

import ast
import inspect
import threading
import types

from ..kernel.errors import NotInRunError, OutOfOrderError
from .modules import instance_forward, set_instance_forward
from .points import Point

__all__ = ["Source", "SourceOp", "SourcePoint", "source_of", "source_info"]

_FRAME_SENSITIVE = {"super", "locals", "globals", "vars", "eval", "exec", "dir", "_getframe", "currentframe"}
_CALL = "__ai_call__"


class OpInfo:
    """One call site in a rewritten function."""

    __slots__ = ("index", "name", "lineno", "col", "text", "func_path")

    def __init__(self, index, name, lineno, col, text, func_path=None):
        self.func_path = func_path   # ("root", "attr", ...) when the callee is a dotted name
        self.index = index
        self.name = name
        self.lineno = lineno
        self.col = col
        self.text = text

    def __repr__(self):
        return f"<op {self.name} line {self.lineno}: {self.text}>"


class SourceInfo:
    """A function's rewritten code and its call sites (one per function, cached)."""

    def __init__(self, fn, owner=None):
        self.wrapped = fn
        fn = inspect.unwrap(fn)   # decorators are re-applied to the rewritten function in build()
        self.fn = fn
        self.owner = owner
        self.qualname = getattr(fn, "__qualname__", fn.__name__)
        try:
            lines, start = inspect.getsourcelines(fn)
            self.filename = inspect.getsourcefile(fn) or fn.__code__.co_filename
        except (OSError, TypeError) as exc:
            raise TypeError(f"the source of {self.qualname} is not available ({exc}); source-level hook points "
                            "need a forward written in Python in a file") from None
        self.start = start
        self.lines = [line.rstrip("\n") for line in lines]
        # parse inside an `if 1:` block instead of dedenting: robust to string literals with odd indentation
        text = "".join(lines)
        if lines and lines[0][:1] in (" ", "\t"):
            tree = ast.parse("if 1:\n" + text)
            ast.increment_lineno(tree, start - 2)
            funcdef = tree.body[0].body[0]
        else:
            tree = ast.parse(text)
            ast.increment_lineno(tree, start - 1)
            funcdef = tree.body[0]
        if not isinstance(funcdef, (ast.FunctionDef, ast.AsyncFunctionDef)):
            raise TypeError(f"{self.qualname} is not a function definition")
        self.decorators = [compile(ast.fix_missing_locations(ast.Expression(d)), self.filename, "eval")
                           for d in funcdef.decorator_list] if self.wrapped is not fn else []
        funcdef.decorator_list = []
        self.ops = []
        rewriter = _Rewriter(self.ops, fn.__globals__, owner)
        funcdef.body = [rewriter.visit(stmt) for stmt in funcdef.body]
        _strip_signature_evaluation(funcdef)
        uses_super = rewriter.uses_super
        if uses_super:
            funcdef.body.insert(0, ast.copy_location(ast.Expr(ast.Name("__class__", ast.Load())), funcdef.body[0]))
        self.freevars = [v for v in fn.__code__.co_freevars if v != "__class__"]
        params = ", ".join([_CALL, "__class__"] + self.freevars)
        factory = ast.parse(f"def __ai_factory__({params}):\n    pass\n").body[0]
        factory.body = [funcdef, ast.Return(ast.Name(funcdef.name, ast.Load()))]
        module = ast.Module(body=[factory], type_ignores=[])
        ast.fix_missing_locations(module)
        code = compile(module, self.filename, "exec")
        self._factory_code = next(c for c in code.co_consts
                                  if isinstance(c, types.CodeType) and c.co_name == "__ai_factory__")
        self.by_name = {op.name: op for op in self.ops}
        self.seen = {}   # op index -> the function last called there (recorded while patched)

    def build(self, call):
        """A new function like ``fn`` whose call sites go through ``call(i, f, *args, **kwargs)``."""
        fn = self.fn
        factory = types.FunctionType(self._factory_code, fn.__globals__, "__ai_factory__")
        closure = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in (fn.__closure__ or ()))))
        new = factory(call, self.owner, *[closure[v] for v in self.freevars])
        new.__defaults__ = fn.__defaults__
        new.__kwdefaults__ = fn.__kwdefaults__
        new.__annotations__ = dict(getattr(fn, "__annotations__", {}))
        new.__qualname__ = self.qualname
        new.__name__ = fn.__name__
        new.__doc__ = fn.__doc__
        new.__module__ = fn.__module__
        for dec in reversed(self.decorators):
            new = eval(dec, fn.__globals__)(new)  # noqa: S307 - the module's own decorator expressions
        return new

    def listing(self, header: str | None = None) -> str:
        per_line = {}
        for op in self.ops:
            per_line.setdefault(op.lineno, []).append(op.name)
        width = max([len(op.name) for op in self.ops] + [4])
        out = [header or f"{self.qualname}  ({self.filename}:{self.start})"]
        for offset, text in enumerate(self.lines):
            lineno = self.start + offset
            names = per_line.get(lineno, [])
            out.append(f" {names[0] if names else '':<{width}}  {lineno:>4} | {text}")
            for extra in names[1:]:
                out.append(f" {extra:<{width}}  {'':>4} |")
        return "\n".join(out)


class _Rewriter(ast.NodeTransformer):
    def __init__(self, ops, fn_globals, owner):
        self.ops = ops
        self.globals = fn_globals
        self.counts = {}
        self.uses_super = False
        self.mangle_prefix = f"_{owner.__name__.lstrip('_')}" if owner is not None else None

    def visit_Name(self, node):
        if node.id == "super":
            self.uses_super = True
        node.id = self._mangle(node.id)
        return node

    def visit_Attribute(self, node):
        self.generic_visit(node)
        node.attr = self._mangle(node.attr)
        return node

    def _mangle(self, name):
        if self.mangle_prefix and name.startswith("__") and not name.endswith("__") and name != _CALL:
            return self.mangle_prefix + name
        return name

    def visit_Call(self, node):
        text = ast.unparse(node)
        if len(text) > 80:
            text = text[:77] + "..."
        func = node.func
        sensitive = (isinstance(func, ast.Name) and func.id in _FRAME_SENSITIVE) or \
                    (isinstance(func, ast.Attribute) and func.attr in _FRAME_SENSITIVE)
        name = None if sensitive else self._name_of(func)
        self.generic_visit(node)
        if sensitive:
            return node
        n = self.counts.get(name, 0)
        self.counts[name] = n + 1
        op = OpInfo(len(self.ops), f"{name}_{n}", node.lineno, node.col_offset, text, _dotted(func))
        self.ops.append(op)
        call = ast.Call(func=ast.Name(_CALL, ast.Load()),
                        args=[ast.Constant(op.index), node.func, *node.args], keywords=node.keywords)
        return ast.copy_location(call, node)

    def _name_of(self, func) -> str:
        parts = []
        f = func
        while isinstance(f, ast.Attribute):
            parts.append(f.attr)
            f = f.value
        if isinstance(f, ast.Name):
            root = f.id
            if not parts:
                return root
            if root == "self" or isinstance(self.globals.get(root), types.ModuleType):
                return "_".join([root] + parts[::-1])
            return parts[0]
        if parts:
            return parts[0]
        return "call"


def _dotted(func):
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        return (func.id, *parts[::-1])
    return None


def _strip_signature_evaluation(funcdef):
    """Defaults and annotations are copied from the original function instead of re-evaluated."""
    args = funcdef.args
    args.defaults = [ast.Constant(None) for _ in args.defaults]
    args.kw_defaults = [None if d is None else ast.Constant(None) for d in args.kw_defaults]
    for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]:
        if a is not None:
            a.annotation = None
    funcdef.returns = None


_infos = {}
_infos_lock = threading.Lock()


def source_info(fn, owner=None) -> SourceInfo:
    """The (cached) rewritten form of function ``fn``; ``owner`` is the class it is a method of."""
    key = (fn, owner)
    info = _infos.get(key)
    if info is None:
        with _infos_lock:
            info = _infos.get(key)
            if info is None:
                info = _infos[key] = SourceInfo(fn, owner)
    return info


def _forward_of(module):
    cls = type(module)
    for klass in cls.__mro__:
        forward = vars(klass).get("forward")
        if forward is not None:
            return forward, klass
    raise TypeError(f"{cls.__name__} has no forward method")


# --------------------------------------------------------------- envoy side
class Source:
    """``envoy.source``: the calls in a module's ``forward`` (or in a function one of them calls), as hook points.

    Print it to list them; ``source.<name>`` is a :class:`SourceOp`.
    """

    def __init__(self, envoy, info=None, parent=None):
        if info is None:
            fn, owner = _forward_of(envoy.module)
            info = source_info(fn, owner)
        self.envoy = envoy
        self.info = info
        self.caller = parent           # the SourceOp whose callee this is (None: the module's forward)
        self.target = None             # the function this source is of, when it is a callee
        self._ops = {}
        self.prefix = f"{_path(envoy)}.source" if parent is None else f"{parent.describe()}.source"

    @property
    def ops(self) -> list:
        """Every call site, in source order."""
        return [self._op(info) for info in self.info.ops]

    def names(self) -> list:
        return [op.name for op in self.info.ops]

    def _op(self, info):
        op = self._ops.get(info.index)
        if op is None:
            op = self._ops[info.index] = SourceOp(self, info)
        return op

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        # (an op whose name clashes with an attribute of Source: use source["name"])
        info = self.info.by_name.get(name)
        if info is None:
            import difflib
            close = difflib.get_close_matches(name, list(self.info.by_name), n=3, cutoff=0.4)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise AttributeError(f"{self.info.qualname} has no call named {name!r}.{hint} "
                                 f"print({self.prefix}) lists them")
        return self._op(info)

    def __getitem__(self, name):
        return self.__getattr__(name)

    def __dir__(self):
        return list(self.info.by_name)

    def __iter__(self):
        return iter(self.ops)

    def __len__(self):
        return len(self.info.ops)

    def __repr__(self):
        return self.info.listing(f"{self.prefix}: {self.info.qualname}  "
                                  f"({self.info.filename}:{self.info.start})")


class SourceOp:
    """One call site: ``.output`` and ``.inputs`` hook points, and ``.source`` of the function it calls."""

    def __init__(self, source, info):
        self.source_of_parent = source
        self.info = info
        self._output = SourcePoint(self, "output")
        self._inputs = SourcePoint(self, "inputs")
        self._callee_sources = {}

    @property
    def output(self) -> "SourcePoint":
        """What the call returned (assign to replace it for this invoke)."""
        return self._output

    @output.setter
    def output(self, value):
        self._output.replace(value)

    @property
    def inputs(self) -> "SourcePoint":
        """``(args, kwargs)`` the call receives (assign to replace them for this invoke)."""
        return self._inputs

    @inputs.setter
    def inputs(self, value):
        self._inputs.replace(value)

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def line(self) -> int:
        return self.info.lineno

    @property
    def code(self) -> str:
        return self.info.text

    def describe(self) -> str:
        return f"{self.source_of_parent.prefix}.{self.name}"

    # ------------------------------------------------------------ nesting
    @property
    def source(self) -> Source:
        """The calls inside the Python function this call site calls, as hook points.

        The callee is found from the code (a global function, a method of
        ``self``, a function of an imported module) or, when it is chosen at
        run time (``attention_interface = ...``), from an earlier run that
        used this module's source points; otherwise name it with
        :meth:`source_of`.
        """
        callee = self._callee()
        if callee is None:
            raise AttributeError(
                f"{self.describe()} calls a function chosen at run time ({self.code}); name it: "
                f"`.source_of(the_function)`, or run once with any source point of this module awaited")
        return self.source_of(callee)

    def source_of(self, fn) -> Source:
        """The source of ``fn`` as called from this call site (its points fire when this site calls ``fn``)."""
        import torch
        if isinstance(fn, torch.nn.Module):
            raise TypeError(f"{self.describe()} calls a module; use the module's own envoy `.source` instead")
        target = getattr(fn, "__func__", fn)
        if not isinstance(target, types.FunctionType):
            raise TypeError(f"{self.describe()}: {fn!r} is not a Python function, it has no source to hook")
        src = self._callee_sources.get(target)
        if src is None:
            src = self._callee_sources[target] = Source(self.source_of_parent.envoy, source_info(target), self)
            src.target = target
        return src

    def _callee(self):
        info = self.info
        spec = info.func_path
        parent_info = self.source_of_parent.info
        if spec is not None:
            root, parts = spec[0], spec[1:]
            obj = _MISSING
            if root == "self" and self.source_of_parent.caller is None:
                obj = type(self.source_of_parent.envoy.module)
            elif root in parent_info.fn.__globals__:
                obj = parent_info.fn.__globals__[root]
            for part in parts:
                if obj is _MISSING or obj is None:
                    break
                obj = getattr(obj, part, None)
            target = getattr(obj, "__func__", obj)
            if isinstance(target, types.FunctionType):
                return target
        return parent_info.seen.get(info.index)

    def __repr__(self):
        return f"<source op {self.describe()} (line {self.line}): {self.code}>"


_MISSING = object()


def _path(envoy):
    return envoy.path or "<root>"


class SourcePoint(Point):
    """An awaitable source-level hook point (``envoy.source.<op>.output`` / ``.inputs``)."""

    __slots__ = ("op", "kind", "envoy", "base_kind", "position")

    kind_label = "source points"

    def __init__(self, op, kind):
        self.op = op
        self.kind = kind
        self.envoy = op.source_of_parent.envoy
        self.key = self
        self.read = None
        self.write = None
        self.gradient = None
        self.base_kind = kind
        # inside the module: after its input, so a point that ran before the module started is out of order
        self.position = (self.envoy.module, "inputs")

    def describe(self) -> str:
        return f"{self.op.describe()}.{self.kind}"

    def __repr__(self):
        return f"<source point {self.describe()} (line {self.op.line})>"

    def activate_in(self, run, task) -> None:
        envoy = self.envoy
        if envoy.root is not run.model:
            raise NotInRunError(f"{self.describe()} belongs to another wrapped model")
        patches = run.state(SourcePoint)
        module = envoy.module
        calls = patches.get(module)
        if calls is None:
            if run.in_firing(envoy.inputs.key):
                raise OutOfOrderError(
                    f"awaited {self.describe()} while {_path(envoy)} is starting (at its input): torch has already "
                    "chosen the forward for this call, so a source point can only be added before the module "
                    f"starts. Wait for both at once: `x, v = await ai.gather({_path(envoy)}.input, "
                    f"{self.describe()})`, or await the source point first")
            calls = patches[module] = _Calls(run, source_of(envoy).info)
            calls.install(module)
            run.keep_alive(module)
            run.keep_ancestors(envoy)
        # walk down from the module's forward through the call sites whose callees hold this point
        chain = []
        src = self.op.source_of_parent
        while src.caller is not None:
            chain.append(src)
            src = src.caller.source_of_parent
        for nested in reversed(chain):
            calls = calls.child(nested.caller.info.index, nested.target, nested.info)
        calls.want(self)


class _Calls:
    """For one run: a rewritten function (a module's forward, or a callee inside it) and the calls it delivers."""

    def __init__(self, run, info, target=None):
        n = len(info.ops)
        self.info = info
        self.target = target
        self.outputs = outputs = [None] * n
        self.inputs = inputs = [None] * n
        self.children = children = {}
        seen = info.seen
        fire = run.fire

        def __ai_call__(index, fn, *args, **kwargs):
            if run.in_adhoc_call:
                return fn(*args, **kwargs)
            p = inputs[index]
            if p is not None:
                new = fire(p, (args, kwargs))
                if new is not None:
                    args, kwargs = new
                    args = tuple(args)
            callee = getattr(fn, "__func__", fn)
            seen[index] = callee
            child = children.get(index) if children else None
            if child is not None and callee is child.target:
                if callee is not fn:   # a bound method: pass its self
                    out = child.function(fn.__self__, *args, **kwargs)
                else:
                    out = child.function(*args, **kwargs)
            else:
                out = fn(*args, **kwargs)
            p = outputs[index]
            if p is not None:
                new = fire(p, out)
                if new is not None:
                    out = new
            return out

        self.run = run
        self.function = info.build(__ai_call__)
        self.module = None
        self.forward = None

    def install(self, module):
        if instance_forward(module) is not None:
            raise NotInRunError(
                f"{type(module).__name__}.forward was replaced on this instance (by another library or a skip "
                "in this run); source-level hook points need the class's own forward")
        self.module = module
        self.forward = types.MethodType(self.function, module)
        set_instance_forward(module, self.forward)
        self.run.on_cleanup(self)

    def child(self, index, target, info):
        c = self.children.get(index)
        if c is None or c.target is not target:
            c = self.children[index] = _Calls(self.run, info, target)
        return c

    def want(self, point):
        table = self.outputs if point.kind == "output" else self.inputs
        table[point.op.info.index] = point

    def remove(self):
        if self.module is not None and instance_forward(self.module) is self.forward:
            set_instance_forward(self.module, None)


def source_of(envoy) -> Source:
    """``envoy.source`` (cached per envoy)."""
    points = envoy.points
    src = points.get(_SOURCE_KEY)
    if src is None:
        src = points[_SOURCE_KEY] = Source(envoy)
    return src


_SOURCE_KEY = ("source",)   # not a string: never clashes with a point name
