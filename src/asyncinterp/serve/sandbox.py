"""Client-submitted interventions: checked, restricted, instrumented. Best effort, not a security boundary.

A server started with ``allow_code=True`` accepts the source of an ``async
def`` from clients. Before any model work the source is

1. parsed and checked (:func:`check_source`): imports only from the
   whitelist (``torch``, ``torch.nn.functional``, ``torch.linalg``,
   ``torch.fft``, ``torch.special``, ``math``, ``asyncinterp``); no attribute or
   name starting with an underscore (no ``__class__``, ``__globals__``,
   ``_module``); no attribute from a deny list (``format``, ``numpy``,
   ``tofile``, ``storage``, ``as_strided``, frame and code attributes such as
   ``gi_frame``/``f_globals``...); no classes, no ``match``; at module level
   only imports, function definitions and literal constants; a size limit.
   Anything else is a :class:`SandboxRefused` (HTTP 400) naming the line.
2. instrumented: every loop body, function body, lambda and comprehension
   calls a tick that raises :class:`SandboxTimeout` once the request's
   deadline has passed or the request was cancelled, so a runaway Python
   loop ends that request only.
3. executed with restricted builtins (no ``open``, ``eval``, ``exec``,
   ``getattr``, ``type``, ``__import__``...) and an import hook that hands
   out proxy modules exposing an allow-list of attributes: torch's tensor
   operators but not ``torch.load``/``save``/``from_file``, ``torch.os``,
   ``torch.hub``, ``torch.set_num_threads`` and friends.
4. given a restricted view of the model (:class:`SafeEnvoy`): submodules,
   hook points, ``skip``, ad-hoc calls, ``steps``/``stop`` — not the
   ``nn.Module``, its parameters or its methods.

What this does not do (see docs/serving.md, "Security"): Python has no real
in-process sandbox. A bug in these checks, in CPython or in a torch operator
may let determined code escape; long-running single C calls (a huge
``torch.zeros``, ``sum(range(10**12))``) cannot be interrupted; memory is not
limited. Enable submitted code only for users you would let run code on the
machine, or run the server in a container/VM with no secrets.
"""

from __future__ import annotations

import ast
import builtins
import hashlib
import inspect
import linecache
import math
import threading
import time
from collections import OrderedDict

import torch
import torch.nn.functional as F

from ..hooks.modules import submodules

MAX_SOURCE_CHARS = 20_000
MAX_AST_NODES = 5_000
MAX_NESTING = 60
MAX_RANGE = 10_000_000
MAX_CREATE_ELEMENTS = 2**26

ALLOWED_MODULES = ("torch", "torch.nn", "torch.nn.functional", "torch.linalg", "torch.fft", "torch.special",
                   "math", "asyncinterp", "asyncinterp.serve")

# attribute names refused on any object (in addition to every name starting with "_")
DENIED_ATTRS = frozenset({
    # string formatting walks attributes by name ("{0.__class__}".format(x))
    "format", "format_map",
    # files, processes, shared memory, raw storage, escaping the invoke's rows
    "numpy", "tofile", "dump", "dumps", "save", "load", "from_file", "to_dlpack", "share_memory_",
    "storage", "untyped_storage", "storage_offset", "data_ptr", "as_strided", "as_strided_", "set_",
    "resize_", "resize_as_", "pin_memory", "mro", "register_hook", "register_post_accumulate_grad_hook",
    "backward", "grad_fn", "requires_grad_", "module", "envoy",
    # introspection of frames, code, generators, functions
    "gi_frame", "gi_code", "gi_yieldfrom", "cr_frame", "cr_code", "cr_await", "ag_frame", "ag_code", "ag_await",
    "f_globals", "f_locals", "f_builtins", "f_back", "f_code", "tb_frame", "tb_next", "co_code", "func_globals",
    "with_traceback",
    # modules hanging off allowed modules (torch.os, torch.hub, ...): refused by name before running
    "os", "sys", "subprocess", "socket", "shutil", "builtins", "importlib", "ctypes", "pathlib", "io", "pickle",
    "marshal", "multiprocessing", "threading", "signal", "hub", "jit", "ops", "classes", "library",
    "distributed", "serialization", "package", "utils", "cpp_extension", "system", "popen",
})

# builtins that submitted code does not get: refused by name before running, with the reason
DENIED_NAMES = {
    "open": "submitted code has no file access",
    "exec": "submitted code cannot run other code", "eval": "submitted code cannot run other code",
    "compile": "submitted code cannot run other code",
    "getattr": "attributes are looked up by name only in the source", "setattr": "attributes are read-only",
    "delattr": "attributes are read-only", "hasattr": "attributes are looked up by name only in the source",
    "globals": "no introspection", "locals": "no introspection", "vars": "no introspection", "dir": "no introspection",
    "type": "no introspection", "object": "no introspection", "super": "classes are not allowed",
    "input": "there is no console", "breakpoint": "there is no console", "help": "there is no console",
    "exit": "the server does not exit", "quit": "the server does not exit", "memoryview": "no raw memory",
    "classmethod": "classes are not allowed", "staticmethod": "classes are not allowed",
    "property": "classes are not allowed",
}

_DENIED_TORCH = frozenset({
    "from_file", "as_strided", "as_strided_", "empty_strided", "load", "save", "set_num_threads",
    "set_num_interop_threads", "manual_seed", "seed", "set_rng_state", "set_default_dtype",
    "set_default_device", "set_default_tensor_type", "set_printoptions", "set_flush_denormal",
    "set_grad_enabled", "use_deterministic_algorithms", "set_warn_always", "set_anomaly_enabled",
    "compile", "vmap", "cond", "while_loop", "fork", "wait", "from_dlpack", "to_dlpack", "import_ir_module",
    "import_ir_module_from_buffer", "parse_ir", "set_float32_matmul_precision", "prepare_multiprocessing_environment",
    "get_file_path", "set_autocast_enabled", "init_num_threads",
})
_TORCH_PY_EXTRAS = ("einsum", "split", "norm", "meshgrid", "broadcast_shapes", "broadcast_tensors", "unique",
                    "unravel_index", "tensordot", "cdist", "atleast_1d", "atleast_2d", "atleast_3d", "chain_matmul",
                    "block_diag", "cartesian_prod", "stft", "istft", "is_tensor", "get_default_dtype",
                    "is_floating_point", "is_complex", "numel", "typename")
_CREATORS = ("zeros", "ones", "empty", "full", "rand", "randn", "randint", "eye", "arange", "linspace", "logspace",
             "randperm", "tensor", "zeros_like", "ones_like", "full_like", "empty_like", "rand_like", "randn_like")

_SAFE_BUILTIN_NAMES = (
    "abs", "all", "any", "ascii", "bin", "bool", "bytes", "callable", "chr", "complex", "dict", "divmod",
    "enumerate", "filter", "float", "frozenset", "hash", "hex", "id", "int", "isinstance", "issubclass", "iter",
    "len", "list", "map", "max", "min", "next", "oct", "ord", "pow", "repr", "reversed", "round", "set", "slice",
    "sorted", "str", "sum", "tuple", "zip", "print",
    "ArithmeticError", "AssertionError", "AttributeError", "Exception", "IndexError", "KeyError", "LookupError",
    "NotImplementedError", "RuntimeError", "StopAsyncIteration", "StopIteration", "TypeError", "ValueError",
    "ZeroDivisionError", "OverflowError", "True", "False", "None",
)


class SandboxRefused(ValueError):
    """Submitted source was refused before running (the reason names the line)."""


class SandboxTimeout(BaseException):
    """Raised inside submitted code when its request's deadline passed or it was cancelled.

    A ``BaseException`` so that ``except Exception`` in the submitted code
    does not swallow it; the tick raises again at the next loop iteration or
    call anyway.
    """


# --------------------------------------------------------------------------- static checks
def _where(node) -> str:
    return f"line {getattr(node, 'lineno', '?')}"


POINT_NAMES = frozenset({"output", "input", "inputs", "logits", "tokens"})


class _Checker(ast.NodeVisitor):
    def __init__(self):
        self.nodes = 0
        self.depth = 0
        self.allowed_stores = set()

    def generic_visit(self, node):
        self.nodes += 1
        if self.nodes > MAX_AST_NODES:
            raise SandboxRefused(f"submitted code is too large (more than {MAX_AST_NODES} syntax nodes)")
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise SandboxRefused(f"submitted code is nested too deeply at {_where(node)}")
        try:
            super().generic_visit(node)
        finally:
            self.depth -= 1

    # --- refused constructs
    def visit_ClassDef(self, node):
        raise SandboxRefused(f"class definitions are not allowed in submitted code ({_where(node)})")

    def visit_Match(self, node):
        raise SandboxRefused(f"match statements are not allowed in submitted code ({_where(node)})")

    def visit_Global(self, node):
        raise SandboxRefused(f"global statements are not allowed in submitted code ({_where(node)})")

    def visit_Nonlocal(self, node):
        self.generic_visit(node)

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
            _check_attr(alias.name, node)
            if alias.asname:
                _check_name(alias.asname, node)
        self.generic_visit(node)

    def visit_Attribute(self, node):
        _check_attr(node.attr, node)
        if not isinstance(node.ctx, ast.Load) and id(node) not in self.allowed_stores:
            raise SandboxRefused(
                f"assigning or deleting attribute {node.attr!r} is not allowed in submitted code ({_where(node)}); "
                "only hook points can be assigned (`m.layer.output = value`, as a single assignment)")
        self.generic_visit(node)

    def visit_Assign(self, node):
        if len(node.targets) == 1 and isinstance(node.targets[0], ast.Attribute) \
                and node.targets[0].attr in POINT_NAMES:
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
    if name not in ALLOWED_MODULES:
        raise SandboxRefused(
            f"import of {name!r} is not allowed in submitted code ({_where(node)}); allowed modules: "
            f"{', '.join(ALLOWED_MODULES)}. Submitted code has no file, network or process access.")


def _check_attr(attr: str, node) -> None:
    if attr.startswith("_"):
        raise SandboxRefused(f"attribute {attr!r} is not allowed in submitted code ({_where(node)}): names "
                             "starting with an underscore are private")
    if attr in DENIED_ATTRS:
        raise SandboxRefused(f"attribute {attr!r} is not allowed in submitted code ({_where(node)})")


def _check_name(name: str, node) -> None:
    if name.startswith("__"):
        raise SandboxRefused(f"name {name!r} is not allowed in submitted code ({_where(node)})")


def _bound_names(tree) -> set:
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


def _check_denied_builtins(tree) -> None:
    bound = _bound_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in DENIED_NAMES and node.id not in bound:
            raise SandboxRefused(f"{node.id!r} is not available in submitted code ({_where(node)}): "
                                 f"{DENIED_NAMES[node.id]}")


def _is_literal(node) -> bool:
    try:
        ast.literal_eval(node)
    except Exception:
        return False
    return True


def _check_top_level(tree) -> None:
    for stmt in tree.body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if stmt.decorator_list:
                raise SandboxRefused(f"decorators are not allowed on top-level functions ({_where(stmt)})")
            for d in stmt.args.defaults + [d for d in stmt.args.kw_defaults if d is not None]:
                if not _is_literal(d):
                    raise SandboxRefused(f"default values of top-level functions must be literals ({_where(d)})")
            if stmt.returns is not None or any(a.annotation is not None for a in ast.walk(stmt.args)
                                               if isinstance(a, ast.arg)):
                _strip_annotations(stmt)
            continue
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # docstring
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None and _is_literal(stmt.value):
            continue
        raise SandboxRefused(
            f"only imports, function definitions and literal constants are allowed at the top level of submitted "
            f"code ({_where(stmt)})")


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
    if len(source) > MAX_SOURCE_CHARS:
        raise SandboxRefused(f"submitted code is too long ({len(source)} > {MAX_SOURCE_CHARS} characters)")
    if "\x00" in source:
        raise SandboxRefused("submitted code contains a NUL character")
    depth = 0
    for ch in source:  # cheap guard before the parser sees pathological nesting
        if ch in "([{":
            depth += 1
            if depth > MAX_NESTING:
                raise SandboxRefused("submitted code is nested too deeply")
        elif ch in ")]}":
            depth -= 1
    try:
        tree = ast.parse(source, mode="exec")
    except SyntaxError as exc:
        raise SandboxRefused(f"submitted code does not parse: {exc.msg} (line {exc.lineno})") from None
    except (ValueError, RecursionError, MemoryError) as exc:
        raise SandboxRefused(f"submitted code does not parse: {type(exc).__name__}") from None
    _Checker().visit(tree)
    _check_denied_builtins(tree)
    _check_top_level(tree)
    return tree


# --------------------------------------------------------------------------- instrumentation
_TICK = "__ai_tick__"


_SETPOINT = "__ai_setpoint__"


def _tick_call():
    return ast.Call(func=ast.Name(id=_TICK, ctx=ast.Load()), args=[], keywords=[])


def _setpoint(obj, name, value):
    """``obj.name = value`` in submitted code: only hook points of the model envoy may be assigned."""
    if not isinstance(obj, SafeEnvoy):
        raise AttributeError(f"cannot assign {name!r} here: submitted code may only assign hook points of the "
                             f"model (`m.layer.{name} = value`)")
    setattr(obj, name, value)


class _Instrument(ast.NodeTransformer):
    def _body(self, node):
        self.generic_visit(node)
        node.body.insert(0, ast.Expr(value=_tick_call()))
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = _body
    visit_For = visit_AsyncFor = visit_While = _body

    def visit_Lambda(self, node):
        self.generic_visit(node)
        node.body = ast.BoolOp(op=ast.And(), values=[_tick_call(), node.body])
        return node

    def visit_Assign(self, node):
        self.generic_visit(node)
        target = node.targets[0]
        if len(node.targets) == 1 and isinstance(target, ast.Attribute):
            # the base of a store target is already a Load expression
            call = ast.Call(func=ast.Name(id=_SETPOINT, ctx=ast.Load()),
                            args=[target.value, ast.Constant(target.attr), node.value], keywords=[])
            return ast.copy_location(ast.Expr(value=call), node)
        return node

    def visit_comprehension(self, node):
        self.generic_visit(node)
        node.ifs.insert(0, _tick_call())
        return node


def instrument(tree: ast.Module) -> ast.Module:
    tree = _Instrument().visit(tree)
    return ast.fix_missing_locations(tree)


# --------------------------------------------------------------------------- restricted runtime
class _Proxy:
    """A module as submitted code sees it: only allow-listed attributes."""

    __slots__ = ("_name", "_attrs")

    def __init__(self, name, attrs):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_attrs", attrs)

    def __getattr__(self, item):
        attrs = object.__getattribute__(self, "_attrs")
        try:
            return attrs[item]
        except KeyError:
            name = object.__getattribute__(self, "_name")
            raise AttributeError(f"{name}.{item} is not available to submitted code") from None

    def __setattr__(self, key, value):
        raise AttributeError("modules are read-only in submitted code")

    def __dir__(self):
        return sorted(object.__getattribute__(self, "_attrs"))

    def __repr__(self):
        return f"<restricted module {object.__getattribute__(self, '_name')}>"


def _capped_creator(fn, name):
    def create(*args, **kwargs):
        size = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
        if name not in ("tensor",) and not name.endswith("_like") and name not in ("arange", "linspace", "logspace"):
            n = 1
            for d in size:
                if isinstance(d, int):
                    n *= max(d, 0)
            if n > MAX_CREATE_ELEMENTS:
                raise ValueError(f"torch.{name} of {n} elements exceeds the limit for submitted code "
                                 f"({MAX_CREATE_ELEMENTS})")
        if name in ("arange", "linspace", "logspace"):
            nums = [a for a in args if isinstance(a, (int, float))]
            if name == "arange" and nums:
                step = nums[2] if len(nums) > 2 else 1
                lo, hi = (0, nums[0]) if len(nums) == 1 else (nums[0], nums[1])
                if step and abs((hi - lo) / step) > MAX_CREATE_ELEMENTS:
                    raise ValueError(f"torch.arange of that length exceeds the limit for submitted code")
            if name != "arange" and len(args) >= 3 and isinstance(args[2], int) and args[2] > MAX_CREATE_ELEMENTS:
                raise ValueError(f"torch.{name} of that length exceeds the limit for submitted code")
        return fn(*args, **kwargs)
    create.__name__ = name
    return create


def _public_functions(mod, deny=()):
    out = {}
    for name in dir(mod):
        if name.startswith("_") or name in deny:
            continue
        try:
            value = getattr(mod, name)
        except Exception:
            continue
        if inspect.ismodule(value):
            continue
        if callable(value) and not isinstance(value, type):
            out[name] = value
    return out


_MODULES = None
_MODULES_LOCK = threading.Lock()


def _build_modules():
    # torch's native functions: a torch-internal read, kept on purpose. No public torch API lists exactly this
    # set (torch.overrides.get_overridable_functions() lacks e.g. arange, as_tensor and the in-place abs_ ...,
    # so the sandbox's torch would change); dir(torch) would let in far more than functions.
    vf = {n for n in dir(torch._C._VariableFunctions) if not n.startswith("_")}
    t = {}
    for name in sorted(vf | set(_TORCH_PY_EXTRAS)):
        if name in _DENIED_TORCH or "file" in name or name.startswith("set_"):
            continue
        value = getattr(torch, name, None)
        if value is None or inspect.ismodule(value):
            continue
        t[name] = _capped_creator(value, name) if name in _CREATORS else value
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype) and not name.startswith("_"):
            t[name] = value
    for name in ("Tensor", "Size", "dtype", "finfo", "iinfo", "no_grad", "device", "inf", "nan", "pi", "e"):
        if hasattr(torch, name):
            t[name] = getattr(torch, name)
    functional = _Proxy("torch.nn.functional", _public_functions(F, deny={"handle_torch_function",
                                                                           "has_torch_function"}))
    nn = _Proxy("torch.nn", {"functional": functional})
    linalg = _Proxy("torch.linalg", _public_functions(torch.linalg))
    fft = _Proxy("torch.fft", _public_functions(torch.fft))
    special = _Proxy("torch.special", _public_functions(torch.special))
    t.update(nn=nn, linalg=linalg, fft=fft, special=special)
    torch_proxy = _Proxy("torch", t)
    math_proxy = _Proxy("math", {n: getattr(math, n) for n in dir(math) if not n.startswith("_")})

    import asyncinterp as ai
    from .batcher import emit

    def spawn(coro, name=None):
        return ai.spawn(_unwrap(coro), name)

    async def gather(*awaitables):
        return await ai.gather(*[_unwrap(a) for a in awaitables])

    ai_attrs = {"gather": gather, "spawn": spawn, "Future": ai.Future, "emit": emit}
    for name in ("MissedHookPoint", "OutOfOrderError", "ReplacementError", "UnsetFutureError", "AsyncInterpError",
                 "RunStopped"):
        ai_attrs[name] = getattr(ai, name)
    serve_proxy = _Proxy("asyncinterp.serve", {"emit": emit})
    ai_attrs["serve"] = serve_proxy
    return {
        "torch": torch_proxy, "torch.nn": nn, "torch.nn.functional": functional, "torch.linalg": linalg,
        "torch.fft": fft, "torch.special": special, "math": math_proxy,
        "asyncinterp": _Proxy("asyncinterp", ai_attrs), "asyncinterp.serve": serve_proxy,
    }


def modules() -> dict:
    global _MODULES
    with _MODULES_LOCK:
        if _MODULES is None:
            _MODULES = _build_modules()
        return _MODULES


def _restricted_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level:
        raise ImportError("relative imports are not allowed in submitted code")
    mods = modules()
    if name not in mods:
        raise ImportError(f"import of {name!r} is not allowed in submitted code; allowed: {', '.join(ALLOWED_MODULES)}")
    if fromlist:
        return mods[name]
    return mods[name.split(".")[0]]


def _safe_range(*args):
    r = range(*args)
    if len(r) > MAX_RANGE:
        raise ValueError(f"range of {len(r)} items exceeds the limit for submitted code ({MAX_RANGE})")
    return r


def _no_print(*args, **kwargs):
    return None


def safe_builtins() -> dict:
    out = {n: getattr(builtins, n) for n in _SAFE_BUILTIN_NAMES if hasattr(builtins, n)}
    out["range"] = _safe_range
    out["print"] = _no_print
    out["__import__"] = _restricted_import
    return out


# --------------------------------------------------------------------------- the model as submitted code sees it
def _unwrap(x):
    if isinstance(x, SafePoint):
        return object.__getattribute__(x, "_point")
    return x


class Record(dict):
    """A model output (``ModelOutput`` and other mappings) as submitted code sees it: items and attributes."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def sanitize(value, depth=0):
    """What submitted code receives from an await: tensors (the live ones, so in-place edits work),
    numbers, strings and containers of them; any other object (a KV cache holding every request's
    keys and values, a module, a config) becomes ``None``."""
    if isinstance(value, torch.Tensor) or value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return value
    if depth > 16:
        return None
    if isinstance(value, torch.Size):
        return value
    if isinstance(value, tuple):
        return tuple(sanitize(v, depth + 1) for v in value)
    if isinstance(value, list):
        return [sanitize(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return Record((k, sanitize(v, depth + 1)) for k, v in value.items() if isinstance(k, (str, int)))
    return None


def _check_replacement_value(value):
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"submitted code may replace hook points with tensors only, got {type(value).__name__}; "
                        "for tuple or structured outputs, edit the awaited tensors in place")


class SafePoint:
    """A hook point for submitted code: awaitable, replaceable (by a tensor), nothing else."""

    __slots__ = ("_point",)

    def __init__(self, point):
        object.__setattr__(self, "_point", point)

    def __await__(self):
        value = yield from object.__getattribute__(self, "_point").__await__()
        return sanitize(value)

    def replace(self, value):
        _check_replacement_value(value)
        return object.__getattribute__(self, "_point").replace(value)

    set = replace

    def __getattr__(self, item):
        raise AttributeError(f"hook points offer only await, .replace(value) and .set(value) to submitted code")

    def __setattr__(self, key, value):
        raise AttributeError("hook points are read-only")

    def __repr__(self):
        return repr(object.__getattribute__(self, "_point"))


class SafeEnvoy:
    """The model as submitted code sees it: submodules, hook points, skip, ad-hoc calls; no parameters."""

    __slots__ = ("_envoy", "_root")

    def __init__(self, envoy, root=True):
        object.__setattr__(self, "_envoy", envoy)
        object.__setattr__(self, "_root", root)

    def _points(self):
        from ..hooks.envoy import point
        cls = type(object.__getattribute__(self, "_envoy"))
        return {name for k in cls.__mro__ for name, v in vars(k).items() if isinstance(v, point)}

    def __getattr__(self, name):
        envoy = object.__getattribute__(self, "_envoy")
        root = object.__getattribute__(self, "_root")
        if name.startswith("_"):
            raise AttributeError(name)
        if name in submodules(envoy.module):
            return SafeEnvoy(envoy.child(name), False)
        if name in self._points():
            return SafePoint(getattr(envoy, name))
        if name == "path":
            return envoy.path
        if name == "skip":
            return envoy.skip
        if root and name in ("steps", "stop", "generated"):
            return getattr(envoy, name)
        raise AttributeError(
            f"{envoy.path or 'the model'} has no submodule or hook point {name!r} available to submitted code "
            f"(submodules: {', '.join(list(submodules(envoy.module))[:12]) or 'none'})")

    def __setattr__(self, name, value):
        envoy = object.__getattribute__(self, "_envoy")
        if name in self._points():
            _check_replacement_value(value)
            getattr(envoy, name).replace(value)
            return
        raise AttributeError(f"cannot set {name!r}: only hook points can be assigned")

    def __getitem__(self, index):
        envoy = object.__getattribute__(self, "_envoy")
        got = envoy[index]
        if isinstance(got, list):
            return [SafeEnvoy(e, False) for e in got]
        return SafeEnvoy(got, False)

    def __len__(self):
        return len(object.__getattribute__(self, "_envoy"))

    def __iter__(self):
        for e in object.__getattribute__(self, "_envoy"):
            yield SafeEnvoy(e, False)

    def __call__(self, *args, **kwargs):
        return object.__getattribute__(self, "_envoy")(*[_unwrap(a) for a in args], **kwargs)

    def __repr__(self):
        return repr(object.__getattribute__(self, "_envoy"))


# --------------------------------------------------------------------------- compiled programs
class _Clock:
    """Per-request budget the tick checks: deadline and cancellation."""

    __slots__ = ("deadline", "cancelled", "count")

    def __init__(self, deadline=None):
        self.deadline = deadline
        self.cancelled = False
        self.count = 0

    def tick(self):
        self.count += 1
        if self.cancelled:
            raise SandboxTimeout("the request was cancelled")
        if self.deadline is not None and (self.count & 63) == 0 and time.monotonic() > self.deadline:
            self.cancelled = True
            raise SandboxTimeout("the request's time limit was reached while submitted code was running")
        return True


class Program:
    """Checked, instrumented, compiled source; :meth:`bind` makes a fresh intervention per request."""

    def __init__(self, source: str, entry: str | None = None):
        tree = check_source(source)
        asyncs = [s.name for s in tree.body if isinstance(s, ast.AsyncFunctionDef)]
        if entry is None:
            if len(asyncs) != 1:
                raise SandboxRefused(
                    "submitted code must define exactly one top-level `async def` (or name the entry point); "
                    f"found {asyncs or 'none'}")
            entry = asyncs[0]
        elif entry not in asyncs:
            raise SandboxRefused(f"entry point {entry!r} is not a top-level `async def` in the submitted code "
                                 f"(found {asyncs or 'none'})")
        self.entry = entry
        fn_node = next(s for s in tree.body if isinstance(s, ast.AsyncFunctionDef) and s.name == entry)
        a = fn_node.args
        if not (a.posonlyargs + a.args):
            raise SandboxRefused(f"{entry} must take the model as its first argument: `async def {entry}(m, ...)`")
        rest = (a.posonlyargs + a.args)[1:]
        n_def = len(a.defaults)
        positional = [p.arg for p in rest]
        self.required = {p for i, p in enumerate(positional) if i < len(positional) - n_def} if n_def <= len(positional) \
            else set()
        self.required |= {k.arg for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is None}
        self.params = set(positional) | {k.arg for k in a.kwonlyargs}
        self.var_kw = a.kwarg is not None
        digest = hashlib.sha256(source.encode()).hexdigest()[:12]
        self.filename = f"<submitted:{entry}:{digest}>"
        self.source = source
        self.code = compile(instrument(tree), self.filename, "exec")
        linecache.cache[self.filename] = (len(source), None, source.splitlines(True), self.filename)

    def check_params(self, params: dict) -> None:
        if not isinstance(params, dict):
            raise SandboxRefused("params must be a map")
        unknown = [k for k in params if not isinstance(k, str) or (k not in self.params and not self.var_kw)]
        if unknown:
            raise SandboxRefused(f"{self.entry} takes no parameter(s) {unknown}; it takes {sorted(self.params)}")
        missing = sorted(self.required - set(params))
        if missing:
            raise SandboxRefused(f"{self.entry} needs parameter(s) {missing}")
        for k in params:
            if k.startswith("__"):
                raise SandboxRefused(f"parameter name {k!r} is not allowed")

    def bind(self, params: dict, deadline: float | None = None):
        """A fresh intervention for one request: ``(fn, clock)``; runs the module body (defs and imports only)."""
        self.check_params(params)
        clock = _Clock(deadline)
        g = {"__builtins__": safe_builtins(), "__name__": "submitted", _TICK: clock.tick, _SETPOINT: _setpoint}
        exec(self.code, g)  # noqa: S102 - checked and restricted above; top level holds only defs/imports/literals
        entry = g[self.entry]

        async def submitted(m):
            return await entry(SafeEnvoy(m), **params)

        submitted.__qualname__ = submitted.__name__ = self.entry
        return submitted, clock


class ProgramCache:
    """Compiled programs by source (and entry), least recently used first out."""

    def __init__(self, size: int = 128):
        self.size = size
        self._items = OrderedDict()
        self._lock = threading.Lock()

    def get(self, source: str, entry: str | None = None) -> Program:
        key = (source, entry)
        with self._lock:
            prog = self._items.get(key)
            if prog is not None:
                self._items.move_to_end(key)
                return prog
        prog = Program(source, entry)
        with self._lock:
            self._items[key] = prog
            while len(self._items) > self.size:
                _, old = self._items.popitem(last=False)
                linecache.cache.pop(old.filename, None)
        return prog
