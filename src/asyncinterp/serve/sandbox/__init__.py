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
   compute budget is used up (CPU time while its own tasks run, measured
   around every resumption), its deadline has passed (extended by the time
   other requests' code held the worker) or the request was cancelled, so
   a runaway Python loop ends that request only, at that point, while the
   forward goes on for the others.
3. executed with restricted builtins (no ``open``, ``eval``, ``exec``,
   ``getattr``, ``type``, ``id``, ``hash``, ``__import__``...) and an import
   hook that hands out proxy modules holding an allow-list of operations
   (tensor math, indexing, reductions, shape operations, zero-filled
   creation). Every tensor submitted code holds is a :class:`PrivateTensor`:
   a private copy whose ``__torch_function__`` refuses methods, operators,
   properties and functions outside the same allow-list, checks index bounds
   and measures every result on meta tensors against one size cap
   (:data:`MAX_TENSOR_BYTES`) before it is made. Attribute names of known
   torch operations that are not allowed are refused already at step 1.
4. given a restricted view of the model (:class:`SafeEnvoy`): submodules,
   hook points, ``skip``, ad-hoc calls, ``steps``/``stop`` — not the
   ``nn.Module``, its parameters or its methods. Awaited values, ``gather``
   and ``spawn`` results and ad-hoc call results are private copies of the
   request's own rows (other objects, e.g. the KV cache, become ``None``);
   in-place edits of them are written back, checked, through
   ``point.replace`` when the task next awaits (:class:`_Driven`).

What this does not do (see docs/serving.md, "Security"): Python has no real
in-process sandbox. A bug in these checks, in CPython or in a torch operator
may let determined code escape; long-running single C calls (a large
matmul in a loop, ``sum(range(10**7))``) cannot be interrupted; memory of
Python objects is not limited (tensors are, one by one). Enable submitted code only for users you would let run code on the
machine, or run the server in a container/VM with no secrets.
"""

from __future__ import annotations

import ast
import builtins
import copy
import hashlib
import inspect
import linecache
import math
import sys
import threading
import time
from collections import OrderedDict

import torch
import torch.nn.functional as F

from ..hooks.envoy import SEMANTIC_NAMES, Envoy, point as point_descriptor
from ..hooks.modules import submodules
from ..hooks.points import Point
from .batcher import Meter

MAX_SOURCE_CHARS = 20_000
MAX_AST_NODES = 5_000
MAX_NESTING = 60
MAX_RANGE = 10_000_000
MAX_TENSOR_BYTES = 256 * 2**20   # the one size cap on any tensor submitted code makes (256 MiB)

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
    "id": "it reveals memory addresses", "hash": "it reveals memory addresses (object hashes are addresses)",
}

_SAFE_BUILTIN_NAMES = (
    "abs", "all", "any", "ascii", "bin", "bool", "bytes", "callable", "chr", "complex", "dict", "divmod",
    "enumerate", "filter", "float", "frozenset", "hex", "int", "isinstance", "issubclass", "iter",
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


POINT_NAMES = frozenset({"output", "input", "inputs", "logits", "tokens"}) | SEMANTIC_NAMES


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
    if attr in STATIC_DENIED_OPS:
        raise SandboxRefused(f"operation {attr!r} is not available to submitted code ({_where(node)}): it is not "
                             "on the allow-list (tensor math, indexing, reductions, shape operations, zero-filled "
                             "creation)")


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
_PLAIN = "__ai_plain__"


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

    def _plain(self, value):
        return ast.Call(func=ast.Name(id=_PLAIN, ctx=ast.Load()), args=[value], keywords=[])

    def visit_FormattedValue(self, node):
        # f"{x}": the text of x must not show a memory address
        self.generic_visit(node)
        node.value = self._plain(node.value)
        return node

    def visit_BinOp(self, node):
        self.generic_visit(node)
        if isinstance(node.op, ast.Mod):   # "%s" % x
            node.right = self._plain(node.right)
        return node

    def visit_Call(self, node):
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id == "str" and node.args \
                and "str" not in self.bound:
            node.args[0] = self._plain(node.args[0])
        return node

    def visit_comprehension(self, node):
        self.generic_visit(node)
        node.ifs.insert(0, _tick_call())
        return node


def instrument(tree: ast.Module) -> ast.Module:
    inst = _Instrument()
    inst.bound = _bound_names(tree)
    tree = inst.visit(tree)
    return ast.fix_missing_locations(tree)


# --------------------------------------------------------------------------- the allow-list
# Submitted code reaches torch through three doors, all guarded by the same allow-list:
# * the proxy modules its imports get (``torch``, ``torch.nn.functional``...): only the names below;
# * tensor methods, operators and properties: every tensor it holds is a :class:`PrivateTensor`, whose
#   ``__torch_function__`` refuses anything not allowed (torch routes every method, operator, property read
#   and torch function that sees such a tensor through it);
# * attribute names in the source: a known torch operation that is not allowed is refused at submission.
_ELEMENTWISE = """
abs absolute acos arccos acosh arccosh asin arcsin asinh arcsinh atan arctan atan2 arctan2 atanh arctanh add addcdiv
addcmul angle bitwise_and bitwise_not bitwise_or bitwise_xor bitwise_left_shift bitwise_right_shift ceil clamp
clamp_max clamp_min clip conj_physical copysign cos cosh deg2rad digamma div divide erf erfc erfinv exp exp2 expm1
fix float_power floor floor_divide fmax fmin fmod frac frexp gcd heaviside hypot i0 igamma igammac lcm ldexp lerp
lgamma log log10 log1p log2 logaddexp logaddexp2 logical_and logical_not logical_or logical_xor logit maximum minimum
mul multiply mvlgamma nan_to_num neg negative nextafter polygamma positive pow rad2deg reciprocal relu remainder round
rsqrt sgn sigmoid sign signbit sin sinc sinh sqrt square sub subtract tan tanh true_divide trunc xlogy where
hardshrink prelu real imag conj resolve_conj resolve_neg softmax log_softmax
"""
_COMPARE = """
eq ne not_equal lt le gt ge greater greater_equal less less_equal equal isclose allclose isfinite isinf isnan isneginf
isposinf isreal is_nonzero is_same_size isin bucketize searchsorted
"""
_REDUCE = """
sum mean nansum nanmean prod std var std_mean var_mean max min amax amin aminmax argmax argmin all any norm logsumexp
median nanmedian mode cumsum cumprod cummax cummin logcumsumexp count_nonzero dist quantile nanquantile trace diff
unique unique_consecutive sort argsort msort topk kthvalue renorm histc bincount cov corrcoef
"""
_LINALG = """
matmul mm bmm mv dot vdot inner outer ger kron addmm addbmm baddbmm addmv addr cross det logdet slogdet inverse
pinverse matrix_power matrix_exp einsum tensordot cdist chain_matmul cosine_similarity pairwise_distance
"""
_SHAPE = """
reshape view view_as reshape_as flatten unflatten ravel squeeze unsqueeze transpose swapaxes swapdims permute movedim
moveaxis t adjoint narrow select index_select masked_select gather take take_along_dim chunk split tensor_split hsplit
vsplit dsplit unbind flip fliplr flipud roll rot90 tile repeat repeat_interleave expand expand_as broadcast_to diag
diagonal diag_embed diagflat tril triu nonzero argwhere scatter scatter_add scatter_reduce index_add index_copy
index_fill index_put masked_fill masked_scatter unfold clone detach contiguous sum_to_size select_scatter
slice_scatter diagonal_scatter cat concat concatenate stack hstack vstack dstack column_stack row_stack meshgrid
broadcast_tensors atleast_1d atleast_2d atleast_3d block_diag cartesian_prod combinations tril_indices triu_indices
"""
_CONVERT = """
float double half bfloat16 int long short bool byte char cfloat cdouble to type_as cpu cuda item tolist size dim
ndimension numel nelement element_size stride is_floating_point is_complex is_signed is_contiguous bernoulli
multinomial normal
"""
# in-place forms (``x.add_(1)``, ``x.zero_()``): they only ever touch the caller's private copies
_INPLACE_EXTRA = """
zero_ fill_ copy_ normal_ uniform_ bernoulli_ exponential_ random_ fill_diagonal_ put_ masked_fill_ masked_scatter_
index_add_ index_copy_ index_fill_ index_put_ scatter_ scatter_add_ scatter_reduce_ squeeze_ unsqueeze_ t_
transpose_ swapaxes_ swapdims_ cumsum_ cumprod_ tril_ triu_ renorm_ clamp_min_ clamp_max_ nan_to_num_ relu_ lerp_
"""
_PROPERTIES = "shape dtype device ndim T mT H mH real imag is_cuda is_cpu layout requires_grad is_leaf itemsize nbytes"
_OPERATORS = """
__getitem__ __setitem__ __len__ __iter__ __contains__ __bool__ __float__ __int__ __index__ __complex__ __format__
__repr__ __reversed__ __neg__ __pos__ __abs__ __invert__ __round__ __floor__ __ceil__ __trunc__
__eq__ __ne__ __lt__ __le__ __gt__ __ge__
"""
_BINARY = "add sub mul truediv floordiv mod pow matmul and or xor lshift rshift div"
# creation functions: zero-filled or defined memory only, all under the one size cap (MAX_TENSOR_BYTES)
_CREATORS = """
zeros ones full rand randn randint randperm eye arange linspace logspace tensor as_tensor zeros_like ones_like
full_like rand_like randn_like randint_like
"""
_TENSOR_CREATORS = "new_zeros new_ones new_full new_tensor"
_TORCH_ONLY = """
is_tensor numel get_default_dtype result_type promote_types can_cast broadcast_shapes layer_norm group_norm dropout
"""
_FUNCTIONAL = """
adaptive_avg_pool1d adaptive_avg_pool2d adaptive_max_pool1d adaptive_max_pool2d avg_pool1d avg_pool2d batch_norm
bilinear binary_cross_entropy binary_cross_entropy_with_logits celu conv1d conv2d cosine_embedding_loss
cosine_similarity cross_entropy dropout elu embedding gelu glu group_norm gumbel_softmax hardsigmoid hardswish
hardtanh huber_loss instance_norm kl_div l1_loss layer_norm leaky_relu linear log_softmax logsigmoid max_pool1d
max_pool2d mish mse_loss nll_loss normalize one_hot pad pairwise_distance pdist prelu relu relu6 rms_norm selu
sigmoid silu smooth_l1_loss softmax softmin softplus softshrink softsign tanh tanhshrink threshold
scaled_dot_product_attention
"""
_LINALG_MOD = """
norm vector_norm matrix_norm det slogdet inv pinv svd svdvals eig eigh eigvals eigvalsh qr cholesky solve lstsq
matrix_rank matrix_power matrix_exp cross vecdot multi_dot diagonal cond
"""
_FFT_MOD = "fft ifft rfft irfft fft2 ifft2 rfft2 irfft2 fftn ifftn rfftn irfftn fftfreq rfftfreq fftshift ifftshift"
_SPECIAL_MOD = """
erf erfc erfinv expit logit logsumexp softmax log_softmax gammaln digamma psi entr sinc xlogy xlog1py i0 i0e i1 i1e
log1p expm1 exp2 round ndtr ndtri log_ndtr
"""


def _words(*texts) -> set:
    return {w for t in texts for w in t.split()}


_TORCH_FN_NAMES = _words(_ELEMENTWISE, _COMPARE, _REDUCE, _LINALG, _SHAPE, _CONVERT, _CREATORS, _TORCH_ONLY)
_METHOD_NAMES = _words(_ELEMENTWISE, _COMPARE, _REDUCE, _LINALG, _SHAPE, _CONVERT, _INPLACE_EXTRA,
                       _TENSOR_CREATORS, _OPERATORS)
_METHOD_NAMES |= {n + "_" for n in _words(_ELEMENTWISE, _COMPARE) if hasattr(torch.Tensor, n + "_")}
for _op in _BINARY.split():
    _METHOD_NAMES |= {f"__{_op}__", f"__r{_op}__", f"__i{_op}__"}
_CREATOR_NAMES = _words(_CREATORS, _TENSOR_CREATORS)

# reading these does not allocate: no size pre-check
_NO_ALLOC = _words(_PROPERTIES, """size dim ndimension numel nelement element_size stride is_floating_point is_complex
is_signed is_contiguous item tolist __len__ __bool__ __float__ __int__ __index__ __complex__ __format__ __repr__
is_nonzero is_same_size __contains__ equal allclose""")
# output size depends on the data (no meta kernel): checked by rule before running, or bounded by the input
_DATA_DEPENDENT = {"bincount", "repeat_interleave", "nonzero", "argwhere", "masked_select", "unique",
                   "unique_consecutive"}


def _allowed_objects():
    """{torch callable or property getter: name} for every allowed operation on a tensor."""
    out = {}
    for name in _METHOD_NAMES:
        fn = getattr(torch.Tensor, name, None)
        if fn is not None:
            out[fn] = name
    for name in _words(_PROPERTIES):
        prop = getattr(torch.Tensor, name, None)
        if prop is not None and hasattr(prop, "__get__"):
            out[prop.__get__] = name
    for name in _TORCH_FN_NAMES:
        fn = getattr(torch, name, None)
        if fn is not None and callable(fn) and not inspect.ismodule(fn):
            out[fn] = name
    for mod, names in ((F, _FUNCTIONAL), (torch.linalg, _LINALG_MOD), (torch.fft, _FFT_MOD),
                       (torch.special, _SPECIAL_MOD)):
        for name in names.split():
            fn = getattr(mod, name, None)
            if fn is not None:
                out[fn] = f"{mod.__name__}.{name}"
    return out


_ALLOWED_OPS = _allowed_objects()

# known torch operations that are not allowed: refused already at submission when the source names one
_KNOWN_TORCH_NAMES = {n for n in dir(torch.Tensor) if not n.startswith("_")} | \
    {n for n in dir(torch) if not n.startswith("_") and callable(getattr(torch, n, None))}
_PYTHON_ATTRS = {n for t in (str, bytes, list, dict, tuple, set, int, float, complex, BaseException, range, slice)
                 for n in dir(t) if not n.startswith("_")} - {"format", "format_map", "mro"}


def _result_fields() -> set:
    out = set()
    for name in dir(torch.return_types):
        cls = getattr(torch.return_types, name)
        if isinstance(cls, type) and issubclass(cls, tuple):
            out |= {a for a in dir(cls) if not a.startswith("_")} - set(dir(tuple))
    return out


def _static_denied() -> frozenset:
    allowed = _result_fields() | _METHOD_NAMES | _words(_PROPERTIES) | _TORCH_FN_NAMES | _PYTHON_ATTRS | POINT_NAMES | {
        "replace", "set", "skip", "path", "steps", "stop", "generated", "Tensor", "Size", "no_grad", "finfo",
        "iinfo", "device", "dtype", "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8",
        "uint8", "bool", "complex64", "complex128", "long", "nn", "functional", "linalg", "fft", "special", "name",
        "gather", "spawn", "Future", "emit", "serve", "MissedHookPoint", "OutOfOrderError", "ReplacementError",
        "UnsetFutureError", "AsyncInterpError", "RunStopped", "done", "cancel"}
    allowed |= _words(_FUNCTIONAL, _LINALG_MOD, _FFT_MOD, _SPECIAL_MOD) | {n for n in dir(math) if n[0] != "_"}
    return frozenset(_KNOWN_TORCH_NAMES - allowed)


STATIC_DENIED_OPS = _static_denied()


def _user_line() -> str:
    """``line N`` of the innermost frame of submitted code on the stack (for error messages)."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_filename.startswith("<submitted:"):
            return f"line {f.f_lineno}"
        f = f.f_back
    return "an unknown line"


def _refuse(what: str, why: str = "") -> SandboxRefused:
    return SandboxRefused(f"{what} is not available to submitted code ({_user_line()})" + (f": {why}" if why else ""))


# --------------------------------------------------------------------------- private tensors
_DisableTorchFunction = torch._C.DisableTorchFunctionSubclass   # the documented way to call through


def _nbytes(shape, dtype) -> int:
    n = 1
    for d in shape:
        n *= max(int(d), 0)
    return n * (dtype.itemsize if dtype is not None else 4)


def _check_size(what: str, nbytes: int) -> None:
    if nbytes > MAX_TENSOR_BYTES:
        raise SandboxRefused(f"{what} would make a tensor of {nbytes} bytes, which exceeds the limit for "
                             f"submitted code ({MAX_TENSOR_BYTES} bytes) ({_user_line()})")


def _to_meta(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
        return type(x)(_to_meta(v) for v in x) if type(x) in (list, tuple) else x
    return x


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)


def _index_bounds(name, args, kwargs):
    """Index tensors of gather/scatter/index_* must lie inside the indexed dimension (also on GPUs, whose
    kernels do not check: an out-of-range index there is a device assert that kills every request)."""
    if name in ("gather", "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
                "index_select", "index_add", "index_add_", "index_copy", "index_copy_", "index_fill", "index_fill_",
                "take_along_dim"):
        if len(args) < 2:
            return
        src = args[0]
        dim = args[1] if name != "take_along_dim" else (args[2] if len(args) > 2 else kwargs.get("dim"))
        idx = args[2] if name != "take_along_dim" else args[1]
        idx = kwargs.get("index", idx)
        if not isinstance(src, torch.Tensor) or not isinstance(idx, torch.Tensor) or idx.numel() == 0:
            return
        size = src.numel() if dim is None else src.shape[int(dim)] if src.dim() else 1
    elif name in ("take", "put_"):
        src, idx = (args + (None, None))[:2]
        if not isinstance(src, torch.Tensor) or not isinstance(idx, torch.Tensor) or idx.numel() == 0:
            return
        size = src.numel()
    else:
        return
    with _DisableTorchFunction():
        lo, hi = int(idx.min()), int(idx.max())
    if lo < -size or hi >= size:
        raise IndexError(f"{name}: index {hi if hi >= size else lo} is out of range for a dimension of size {size} "
                         f"({_user_line()})")


def _data_dependent_check(name, args, kwargs):
    if name == "bincount" and args and isinstance(args[0], torch.Tensor) and args[0].numel():
        with _DisableTorchFunction():
            top = int(args[0].max())
        n = max(top + 1, int(kwargs.get("minlength", args[2] if len(args) > 2 else 0) or 0))
        _check_size("bincount", _nbytes((n,), torch.float64))
    elif name == "repeat_interleave" and args and isinstance(args[0], torch.Tensor):
        reps = args[1] if len(args) > 1 else kwargs.get("repeats")
        src = args[0]
        if isinstance(reps, torch.Tensor):
            with _DisableTorchFunction():
                total = int(reps.sum()) if reps.numel() else 0
            if reps.numel() == 1:
                total = total * src.numel()
            else:
                total = total * max(src.numel() // max(reps.numel(), 1), 1)
        elif isinstance(reps, int):
            total = reps * src.numel()
        else:
            return
        _check_size("repeat_interleave", total * src.element_size())


def _precheck(name, func, args, kwargs):
    """Before an allowed operation runs: index bounds, and the size of what it makes (on meta tensors)."""
    if name in _NO_ALLOC:
        return
    _index_bounds(name, args, kwargs)
    if name in _DATA_DEPENDENT:
        _data_dependent_check(name, args, kwargs)
        return
    try:
        out = func(*_to_meta(args), **{k: _to_meta(v) for k, v in kwargs.items()})
    except Exception:  # noqa: BLE001 - no meta kernel, or invalid arguments: the real call reports those
        return
    for t in _tensors(out):
        _check_size(name, _nbytes(t.shape, t.dtype))


class PrivateTensor(torch.Tensor):
    """The only kind of tensor submitted code holds: its own memory, and allow-listed operations only.

    Every method, operator, property and torch function that sees one of
    these goes through :meth:`__torch_function__`, which refuses operations
    outside the allow-list (naming the user's line), refuses results larger
    than the size cap before they are allocated, and keeps results private.
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _ALLOWED_OPS.get(func)
        if name is None:
            label = getattr(func, "__name__", repr(func))
            if label == "__get__":
                label = getattr(getattr(func, "__self__", None), "__name__", label)
            raise _refuse(f"tensor operation {label!r}")
        with _DisableTorchFunction():
            _precheck(name, func, args, kwargs)
            ret = func(*args, **kwargs)
            if name in ("__iter__", "__reversed__"):
                return iter([_adopt(v) for v in ret])
            return _adopt(ret)


def _adopt(value):
    """Results of allowed operations: plain tensors become :class:`PrivateTensor` (same memory, no copy)."""
    if isinstance(value, torch.Tensor):
        if type(value) is PrivateTensor:
            return value
        with _DisableTorchFunction():
            return value.as_subclass(PrivateTensor)
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        items = [_adopt(v) for v in value]
        if type(value) in (list, tuple):
            return type(value)(items)
        try:
            return type(value)(items)         # torch.return_types (values, indices)
        except TypeError:
            return tuple(items)
    return value


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The same memory as an ordinary tensor (server side only)."""
    with _DisableTorchFunction():
        return t.as_subclass(torch.Tensor)


def private_copy(t: torch.Tensor):
    """``(plain, private)``: a fresh copy of ``t`` and its :class:`PrivateTensor` face (same memory).

    The copy is an ordinary tensor even when the model runs under ``torch.inference_mode`` (vLLM):
    inference tensors have no version counter, which is how in-place edits of the copy are detected.
    """
    with _DisableTorchFunction(), torch.inference_mode(False):
        plain = t.detach().clone() if type(t) is torch.Tensor else _plain(t).detach().clone()
        return plain, plain.as_subclass(PrivateTensor)


def version_of(t: torch.Tensor) -> int:
    """The in-place version counter of ``t`` (shared by its views)."""
    with _DisableTorchFunction():
        return t._version


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
            raise _refuse(f"{name}.{item}") from None

    def __setattr__(self, key, value):
        raise AttributeError("modules are read-only in submitted code")

    def __dir__(self):
        return sorted(object.__getattribute__(self, "_attrs"))

    def __repr__(self):
        return f"<restricted module {object.__getattribute__(self, '_name')}>"


def _creator(fn, name):
    """A factory without tensor inputs: what it would make is measured on the meta device first, so every
    argument form (sizes as varargs, a tuple, ``size=``, a tensor of sizes, ranges) meets the same cap."""
    def create(*args, **kwargs):
        with _DisableTorchFunction():
            try:
                probe = fn(*args, **{**kwargs, "device": "meta"})
            except Exception:  # noqa: BLE001 - invalid arguments: the real call reports them
                probe = None
            if isinstance(probe, torch.Tensor):
                _check_size(f"torch.{name}", _nbytes(probe.shape, probe.dtype))
            out = fn(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                _check_size(f"torch.{name}", _nbytes(out.shape, out.dtype))
            return _adopt(out)
    create.__name__ = name
    return create


def _entry(fn, name):
    """A torch function reachable from submitted code: results become private tensors."""
    if name in _CREATOR_NAMES:
        return _creator(fn, name)

    def call(*args, **kwargs):
        if not any(type(t) is PrivateTensor for t in _tensors((args, kwargs))):
            # nothing private to dispatch on (only Python values): check here what __torch_function__ would
            with _DisableTorchFunction():
                _precheck(name, fn, args, kwargs)
                return _adopt(fn(*args, **kwargs))
        return _adopt(fn(*args, **kwargs))
    call.__name__ = name
    return call


class _TensorTypeMeta(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, torch.Tensor)

    def __subclasscheck__(cls, sub):
        return isinstance(sub, type) and issubclass(sub, torch.Tensor)

    def __call__(cls, *args, **kwargs):
        raise _refuse("torch.Tensor(...)", "it returns uninitialised memory; use torch.zeros / torch.tensor")

    def __getattr__(cls, item):
        raise _refuse(f"torch.Tensor.{item}", "call methods on tensors instead")


class _TensorType(metaclass=_TensorTypeMeta):
    """``torch.Tensor`` for submitted code: ``isinstance(x, torch.Tensor)`` only."""


_MODULES = None
_MODULES_LOCK = threading.Lock()


def _build_modules():
    t = {}
    for name in sorted(_TORCH_FN_NAMES):
        value = getattr(torch, name, None)
        if value is not None and callable(value) and not inspect.ismodule(value):
            t[name] = _entry(value, name)
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype) and not name.startswith("_"):
            t[name] = value
    for name in ("Size", "dtype", "finfo", "iinfo", "no_grad", "device", "inf", "nan", "pi", "e"):
        if hasattr(torch, name):
            t[name] = getattr(torch, name)
    t["Tensor"] = _TensorType

    def sub(mod, names):
        return {n: _entry(getattr(mod, n), n) for n in names.split() if getattr(mod, n, None) is not None}

    functional = _Proxy("torch.nn.functional", sub(F, _FUNCTIONAL))
    nn = _Proxy("torch.nn", {"functional": functional})
    linalg = _Proxy("torch.linalg", sub(torch.linalg, _LINALG_MOD))
    fft = _Proxy("torch.fft", sub(torch.fft, _FFT_MOD))
    special = _Proxy("torch.special", sub(torch.special, _SPECIAL_MOD))
    t.update(nn=nn, linalg=linalg, fft=fft, special=special)
    torch_proxy = _Proxy("torch", t)
    math_proxy = _Proxy("math", {n: getattr(math, n) for n in dir(math) if not n.startswith("_")})

    import asyncinterp as ai
    from .batcher import emit

    ai_attrs = {"gather": _gather, "spawn": _spawn, "Future": ai.Future, "emit": lambda value: emit(release(value))}
    for name in ("MissedHookPoint", "OutOfOrderError", "ReplacementError", "UnsetFutureError", "AsyncInterpError",
                 "RunStopped"):
        ai_attrs[name] = getattr(ai, name)
    serve_proxy = _Proxy("asyncinterp.serve", {"emit": ai_attrs["emit"]})
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


_PLAIN_TYPES = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, torch.Size, slice,
                range, torch.finfo, torch.iinfo)


def _plain_check(value, depth=0):
    """Values submitted code may turn into text: their text shows no memory address."""
    if isinstance(value, _PLAIN_TYPES) or isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (SafeEnvoy, SafePoint)):
        return value
    if depth < 8 and isinstance(value, (list, tuple, set, frozenset)):
        for v in value:
            _plain_check(v, depth + 1)
        return value
    if depth < 8 and isinstance(value, dict):
        for k, v in value.items():
            _plain_check(k, depth + 1)
            _plain_check(v, depth + 1)
        return value
    if depth < 8 and isinstance(value, BaseException):
        _plain_check(value.args, depth + 1)
        return value
    raise _refuse(f"turning a {type(value).__name__} into text", "its text shows a memory address")


def _safe_repr(value):
    return repr(_plain_check(value))


def _safe_ascii(value):
    return ascii(_plain_check(value))


def safe_builtins() -> dict:
    out = {n: getattr(builtins, n) for n in _SAFE_BUILTIN_NAMES if hasattr(builtins, n)}
    out["range"] = _safe_range
    out["print"] = _no_print
    out["repr"] = _safe_repr
    out["ascii"] = _safe_ascii
    out["__import__"] = _restricted_import
    return out


# --------------------------------------------------------------------------- private copies and write-back
class Record(dict):
    """A model output (``ModelOutput`` and other mappings) as submitted code sees it: items and attributes."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def sanitize(value, depth=0, leaves=None, path=()):
    """What submitted code receives: private copies of tensors, numbers, strings and containers of them;
    any other object (a KV cache holding every request's keys and values, a module, a config) becomes
    ``None``. ``leaves`` collects ``(path, plain_copy, version)`` for in-place write-back."""
    if isinstance(value, torch.Tensor):
        plain, private = private_copy(value)
        if leaves is not None:
            leaves.append((path, value, plain, version_of(plain)))
        return private
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return value
    if depth > 16:
        return None
    if isinstance(value, torch.Size):
        return value
    if isinstance(value, tuple):
        return tuple(sanitize(v, depth + 1, leaves, path + (i,)) for i, v in enumerate(value))
    if isinstance(value, list):
        return [sanitize(v, depth + 1, leaves, path + (i,)) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return Record((k, sanitize(v, depth + 1, leaves, path + (k,))) for k, v in value.items()
                      if isinstance(k, (str, int)))
    return None


def scrub(text: str) -> str:
    """Hide memory addresses (``0x7f...``) in text that leaves the server."""
    from .wire import scrub_addresses
    return scrub_addresses(text)


def release(value, depth=0):
    """What leaves submitted code (its result, emitted values): plain tensors, numbers, strings, containers;
    anything else is a ``TypeError``."""
    if isinstance(value, torch.Tensor):
        return _plain(value)
    if isinstance(value, str):
        return scrub(value)
    if value is None or isinstance(value, (bool, int, float, bytes, torch.dtype)):
        return value
    if depth > 30:
        raise TypeError("submitted code returned a value nested too deeply")
    if isinstance(value, torch.Size):
        return tuple(value)
    if isinstance(value, tuple):
        return tuple(release(v, depth + 1) for v in value)
    if isinstance(value, (list, set, frozenset)):
        return [release(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {release(k, depth + 1): release(v, depth + 1) for k, v in value.items()}
    raise TypeError(f"submitted code may return only tensors, numbers, strings and lists/tuples/dicts of them, "
                    f"not a {type(value).__name__}")


def _check_replacement(new: torch.Tensor, old, what: str) -> torch.Tensor:
    if isinstance(old, torch.Tensor):
        if tuple(new.shape) != tuple(old.shape):
            raise ValueError(f"{what}: the replacement has shape {tuple(new.shape)}, the value has "
                             f"{tuple(old.shape)}")
        if new.dtype != old.dtype:
            raise ValueError(f"{what}: the replacement has dtype {new.dtype}, the value has {old.dtype}")
        if new.device != old.device:
            raise ValueError(f"{what}: the replacement is on {new.device}, the value on {old.device}")
    if (new.is_floating_point() or new.is_complex()) and not bool(torch.isfinite(new).all()):
        raise ValueError(f"{what}: the replacement holds inf or nan")
    return new


def _rebuild(value, changes: dict, path=()):
    """``value`` with the leaves at the paths in ``changes`` replaced (other objects kept as they are)."""
    if path in changes:
        return changes[path]
    if not any(p[:len(path)] == path for p in changes):
        return value
    if isinstance(value, tuple):
        items = [_rebuild(v, changes, path + (i,)) for i, v in enumerate(value)]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return [_rebuild(v, changes, path + (i,)) for i, v in enumerate(value)]
    if isinstance(value, dict):
        new = copy.copy(value)
        for k in list(value.keys()):
            new[k] = _rebuild(value[k], changes, path + (k,))
        return new
    return value


class _Pending:
    __slots__ = ("point", "raw", "leaves", "done")

    def __init__(self, point, raw, leaves):
        self.point, self.raw, self.leaves, self.done = point, raw, leaves, False


class _TaskState:
    """Per task of submitted code: awaited values whose private copies may be edited in place, and the
    clock of its request (every resumption of the task is timed on it)."""

    __slots__ = ("pending", "clock")

    def __init__(self, clock=None):
        self.pending = []
        self.clock = clock

    def forget(self, point):
        """An explicit replacement of ``point``: its pending in-place edits are dropped; returns the value."""
        key = getattr(point, "key", point)
        raw = None
        for p in self.pending:
            if getattr(p.point, "key", p.point) == key:
                p.done = True
                raw = p.raw
        return raw

    def flush(self):
        """Write in-place edits of private copies back through ``point.replace`` (called when the task
        awaits something else or returns: while the point is still firing)."""
        pending, self.pending = self.pending, []
        for p in pending:
            if p.done:
                continue
            changes = {}
            for path, raw_leaf, plain, version in p.leaves:
                if version_of(plain) != version:
                    what = f"in-place edit of {p.point.describe() if hasattr(p.point, 'describe') else 'a value'}"
                    changes[path] = _check_replacement(plain.clone(), raw_leaf, what)
            if changes:
                p.point.replace(_rebuild(p.raw, changes))


_LOCAL = threading.local()


def _current_state():
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


class _Driven:
    """Runs a coroutine of submitted code as a task, flushing its in-place edits at every await and
    timing every resumption on its request's clock (the compute budget)."""

    __slots__ = ("coro", "clock")

    def __init__(self, coro, clock=None):
        self.coro = coro
        self.clock = clock

    def __await__(self):
        coro, clock = self.coro, self.clock
        state = _TaskState(clock)
        __ai_inner__ = coro   # lets await_site find the user's line inside the driven coroutine
        stack = getattr(_LOCAL, "stack", None)
        if stack is None:
            stack = _LOCAL.stack = []
        send, exc = None, None
        try:
            while True:
                stack.append(state)
                if clock is not None:
                    clock.resume()
                try:
                    trap = coro.throw(exc) if exc is not None else coro.send(send)
                    state.flush()
                except StopIteration as stop:
                    state.flush()
                    return stop.value
                finally:
                    if clock is not None:
                        clock.pause()
                    stack.pop()
                try:
                    send, exc = (yield trap), None
                except GeneratorExit:
                    raise
                except BaseException as e:  # noqa: BLE001 - delivered to the submitted coroutine
                    send, exc = None, e
        finally:
            if clock is not None:
                clock.resume()   # its finally blocks run now: on its clock too
            try:
                coro.close()
            finally:
                if clock is not None:
                    clock.pause()


async def _await_point(point):
    return await point


def _as_coro(aw):
    if isinstance(aw, SafePoint) or inspect.iscoroutine(aw):
        state = _current_state()   # the submitted task calling spawn/gather: its request's clock
        clock = state.clock if state is not None else None

        async def run():
            return await _Driven(_await_point(aw) if isinstance(aw, SafePoint) else aw, clock)
        return run()
    return aw


def _spawn(coro, name=None):
    import asyncinterp as ai
    return ai.spawn(_as_coro(coro), name)


async def _gather(*awaitables):
    import asyncinterp as ai
    return await ai.gather(*[_as_coro(a) for a in awaitables])


def _check_replacement_value(value):
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"submitted code may replace hook points with tensors only, got {type(value).__name__}; "
                        "for tuple or structured outputs, edit the awaited tensors in place")


def _to_model(value):
    """A tensor of submitted code on its way into the model: a plain copy, checked."""
    _check_replacement_value(value)
    with _DisableTorchFunction():
        return _check_replacement(_plain(value).detach().clone(), None, "replacement")


class SafePoint:
    """A hook point for submitted code: awaitable (a private copy), replaceable (by a tensor), nothing else."""

    __slots__ = ("_point",)

    def __init__(self, point):
        object.__setattr__(self, "_point", point)

    def __await__(self):
        point = object.__getattribute__(self, "_point")
        raw = yield from point.__await__()
        leaves = []
        value = sanitize(raw, leaves=leaves)
        state = _current_state()
        if state is not None and leaves:
            state.pending.append(_Pending(point, raw, leaves))
        return value

    def replace(self, value):
        point = object.__getattribute__(self, "_point")
        new = _to_model(value)
        state = _current_state()
        old = state.forget(point) if state is not None else None
        if isinstance(old, torch.Tensor):
            _check_replacement(new, old, f"replacement of {point.describe()}")
        return point.replace(new)

    set = replace

    def __getattr__(self, item):
        raise AttributeError(f"hook points offer only await, .replace(value) and .set(value) to submitted code")

    def __setattr__(self, key, value):
        raise AttributeError("hook points are read-only")

    def __repr__(self):
        return repr(object.__getattribute__(self, "_point"))


def _standard(envoy, name):
    """A standard name below ``envoy`` for submitted code: an alias (``layers``, ``attn``, ``mlp``) as a
    :class:`SafeEnvoy`, a semantic point (``resid_mid``, ``attn.q``, ``logits``) as a :class:`SafePoint`;
    ``None`` for anything else (module attributes, parameters and buffers stay out of reach)."""
    found = envoy.standard_name(name)
    if isinstance(found, Envoy):
        return SafeEnvoy(found, False)
    if isinstance(found, Point):
        return SafePoint(found)
    return None


_POINT_NAMES = {}   # envoy class -> the names of the hook points it declares (classes are few)


class SafeEnvoy:
    """The model as submitted code sees it: submodules, hook points, skip, ad-hoc calls; no parameters."""

    __slots__ = ("_envoy", "_root")

    def __init__(self, envoy, root=True):
        object.__setattr__(self, "_envoy", envoy)
        object.__setattr__(self, "_root", root)

    def _points(self):
        """The hook point names the envoy's class declares (worked out once per class)."""
        cls = type(object.__getattribute__(self, "_envoy"))
        names = _POINT_NAMES.get(cls)
        if names is None:
            names = _POINT_NAMES[cls] = frozenset(
                name for k in cls.__mro__ for name, v in vars(k).items() if isinstance(v, point_descriptor))
        return names

    def __getattr__(self, name):
        envoy = object.__getattribute__(self, "_envoy")
        root = object.__getattribute__(self, "_root")
        if name.startswith("_"):
            raise AttributeError(name)
        if name in submodules(envoy.module):
            return SafeEnvoy(envoy.child(name), False)
        if name in self._points():
            return SafePoint(getattr(envoy, name))
        found = _standard(envoy, name)
        if found is not None:
            return found
        if name == "path":
            return envoy.path
        if name == "skip":
            def skip(value):
                return envoy.skip(_to_model(value))
            return skip
        if root and name in ("steps", "stop"):
            return getattr(envoy, name)
        if root and name == "generated":
            g = envoy.generated
            return Record(tokens=sanitize(g.tokens), text=g.text)
        raise AttributeError(
            f"{envoy.path or 'the model'} has no submodule or hook point {name!r} available to submitted code "
            f"(submodules: {', '.join(list(submodules(envoy.module))[:12]) or 'none'})")

    def __setattr__(self, name, value):
        envoy = object.__getattribute__(self, "_envoy")
        if name in self._points():
            SafePoint(getattr(envoy, name)).replace(value)
            return
        found = _standard(envoy, name)
        if isinstance(found, SafePoint):    # a semantic point: m.layers[1].resid_post = h
            found.replace(value)
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
        """An ad-hoc call on the caller's own tensors; the answer is a private copy (other objects: None)."""
        def inward(x, depth=0):
            if isinstance(x, torch.Tensor):
                return _plain(x).detach().clone()
            if isinstance(x, (list, tuple)) and depth < 8:
                return type(x)(inward(v, depth + 1) for v in x) if type(x) in (list, tuple) else x
            if isinstance(x, (SafeEnvoy, SafePoint)) or callable(x):
                raise TypeError("ad-hoc module calls take tensors, numbers and strings")
            return x
        envoy = object.__getattribute__(self, "_envoy")
        out = envoy(*[inward(a) for a in args], **{k: inward(v) for k, v in kwargs.items()})
        return sanitize(out)

    def __repr__(self):
        return repr(object.__getattribute__(self, "_envoy"))


# --------------------------------------------------------------------------- compiled programs
class _Clock(Meter):
    """Per-request limits the tick checks: compute budget, deadline, cancellation.

    ``budget``: CPU seconds the request's submitted code may run in all,
    counted only while one of its tasks is resumed (:class:`_Driven` times
    every resumption, in every hook firing and generation step; waiting for
    the model or for other requests costs nothing). ``deadline``: the
    request's wall-clock limit (``time.monotonic()``), extended by its
    credit (:meth:`Meter.credit`: time other requests' code held the worker
    meanwhile). Past either, the next tick raises :class:`SandboxTimeout`
    there, and every tick after it.
    """

    __slots__ = ("deadline", "budget", "cancelled", "reason", "count")

    def __init__(self, deadline=None, budget=None):
        super().__init__()
        self.deadline = deadline
        self.budget = budget
        self.cancelled = False
        self.reason = "the request was cancelled"
        self.count = 0

    def tick(self):
        self.count += 1
        if self.cancelled:
            raise SandboxTimeout(self.reason)
        if (self.count & 31) == 0:
            self.check()
        return True

    def check(self):
        budget = self.budget
        if budget is not None and self.depth:
            used = self.cpu_now()
            if used > budget:
                self.stop(f"submitted code used up its compute budget of {budget:g} s (CPU time while its code "
                          f"ran in hook firings: {used:.3f} s) and was stopped here; the forward went on for "
                          "the other requests")
        deadline = self.deadline
        if deadline is not None and time.monotonic() > deadline and time.monotonic() > deadline + self.credit():
            self.stop("the request's time limit was reached while submitted code was running")

    def stop(self, reason):
        self.cancelled = True
        self.reason = reason
        raise SandboxTimeout(reason)


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

    def bind(self, params: dict, deadline: float | None = None, budget: float | None = None):
        """A fresh intervention for one request: ``(fn, clock)``; runs the module body (defs and imports only).

        ``deadline``: wall-clock limit (``time.monotonic()``); ``budget``: CPU seconds the code may run in
        all (see :class:`_Clock`). The clock is the request's :class:`~asyncinterp.serve.batcher.Meter`:
        pass it to the batcher (``meter=clock``) so that its time is accounted to it and credited to the
        other requests' deadlines.
        """
        self.check_params(params)
        clock = _Clock(deadline, budget)
        g = {"__builtins__": safe_builtins(), "__name__": "submitted", _TICK: clock.tick, _SETPOINT: _setpoint,
             _PLAIN: _plain_check}
        exec(self.code, g)  # noqa: S102 - checked and restricted above; top level holds only defs/imports/literals
        entry = g[self.entry]

        params = {k: sanitize(v) if isinstance(v, (torch.Tensor, list, tuple, dict)) else v
                  for k, v in params.items()}

        async def submitted(m):
            return release(await _Driven(entry(SafeEnvoy(m), **params), clock))

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
