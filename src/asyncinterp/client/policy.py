"""What client-submitted code may do: the sandbox's whole policy, as data, in this one file.

Why it stands outside :mod:`asyncinterp.serve.sandbox`: the client reads it
too (what a capture may name as a module, what ``ai.remote`` checks before
sending), and the client loads no server code; importing the sandbox package
would load the whole sandbox. Its old path ``asyncinterp.serve.sandbox.policy``
still imports (:mod:`asyncinterp.moved`).

Every module of :mod:`asyncinterp.serve.sandbox` takes its decisions
from the names below and from nowhere else: the checker (what source is
refused before it runs), the instrumentation (which attribute reads are
checked when they run), the proxy modules and builtins (what submitted code
can reach), :class:`~.sandbox.tensors.PrivateTensor` (which tensor operations run and
how large their results may be), the model's restricted view and the clock.
A reviewer who wants to know what submitted code may do reads this file.

Everything here is an allow-list except two lists of names refused even
where another rule would let them through (``REFUSED_BUILTINS``,
``REFUSED_ATTRIBUTES``) and the private-name rule: they are a second line,
not the rule.
"""

from __future__ import annotations

import torch

from ..hooks.tl_names import POINT_NAMES as TL_POINT_NAMES

# --------------------------------------------------------------------------- limits
MAX_SOURCE_CHARS = 20_000           # characters of submitted source
MAX_AST_NODES = 5_000               # syntax nodes of submitted source
MAX_NESTING = 60                    # nesting of brackets and of syntax nodes
MAX_RANGE = 10_000_000              # items of one range()
MAX_TENSOR_BYTES = 256 * 2**20      # the one size cap on any tensor submitted code makes (256 MiB)
MAX_VALUE_DEPTH = 16                # nesting of values handed to submitted code (deeper parts become None)
MAX_RESULT_DEPTH = 30               # nesting of what it returns or emits (deeper: refused)
MAX_TEXT_DEPTH = 8                  # nesting of containers it may turn into text (deeper: refused)
MAX_CALL_DEPTH = 8                  # nesting of containers it passes to an ad-hoc module call
TICKS_PER_CLOCK_CHECK = 32          # the compute budget and the deadline are checked every this many ticks
PROGRAM_CACHE_SIZE = 128            # compiled programs kept per server (least recently used first out)

# --------------------------------------------------------------------------- syntax
# constructs refused anywhere in submitted source (ast node class -> what the message calls them)
REFUSED_SYNTAX = {"ClassDef": "class definitions", "Match": "match statements", "Global": "global statements"}
# statements allowed at the top level, so that nothing runs while the module is loaded: imports, function
# definitions (no decorators, literal defaults), a docstring and assignments of literal constants
TOP_LEVEL_STATEMENTS = frozenset({"Import", "ImportFrom", "FunctionDef", "AsyncFunctionDef", "Expr", "Assign",
                                  "AnnAssign"})
# names refused wherever they appear: attributes starting with PRIVATE_ATTRIBUTE (x._module, x.__class__);
# variables, parameters, keywords and params keys starting with PRIVATE_NAME (__builtins__, __import__)
PRIVATE_ATTRIBUTE = "_"
PRIVATE_NAME = "__"
# the only attribute assignments allowed (`m.layer.output = value`, a single target): hook points of the model
ASSIGNABLE_POINTS = frozenset({"output", "input", "inputs", "logits", "tokens",
                               "resid_pre", "resid_mid", "resid_post", "q", "k", "v", "z", "pattern", "pre", "post",
                               "router", "per_expert", "routed", "grad"}) | TL_POINT_NAMES   # blocks.1.hook_resid_post

# --------------------------------------------------------------------------- modules
# `import m`, `import m as x`, `from m import name` of these only (no relative imports, no `import *`)
ALLOWED_MODULES = ("torch", "torch.nn", "torch.nn.functional", "torch.linalg", "torch.fft", "torch.special",
                   "torch.autograd", "math", "asyncinterp", "asyncinterp.serve")


def _words(*texts) -> frozenset:
    return frozenset(w for t in texts for w in t.split())


# Tensor operations, by kind. Submitted code reaches torch through three doors, all guarded by these lists:
# * the proxy modules its imports get: only the names below;
# * tensor methods, operators and properties: every tensor it holds is a PrivateTensor, whose
#   __torch_function__ refuses anything not listed (torch routes every method, operator, property read and
#   torch function that sees such a tensor through it);
# * attribute names in the source: a torch operation that is not listed is refused at submission.
ELEMENTWISE = _words("""
abs absolute acos arccos acosh arccosh asin arcsin asinh arcsinh atan arctan atan2 arctan2 atanh arctanh add addcdiv
addcmul angle bitwise_and bitwise_not bitwise_or bitwise_xor bitwise_left_shift bitwise_right_shift ceil clamp
clamp_max clamp_min clip conj_physical copysign cos cosh deg2rad digamma div divide erf erfc erfinv exp exp2 expm1
fix float_power floor floor_divide fmax fmin fmod frac frexp gcd heaviside hypot i0 igamma igammac lcm ldexp lerp
lgamma log log10 log1p log2 logaddexp logaddexp2 logical_and logical_not logical_or logical_xor logit maximum minimum
mul multiply mvlgamma nan_to_num neg negative nextafter polygamma positive pow rad2deg reciprocal relu remainder round
rsqrt sgn sigmoid sign signbit sin sinc sinh sqrt square sub subtract tan tanh true_divide trunc xlogy where
hardshrink prelu real imag conj resolve_conj resolve_neg softmax log_softmax
""")
COMPARE = _words("""
eq ne not_equal lt le gt ge greater greater_equal less less_equal equal isclose allclose isfinite isinf isnan isneginf
isposinf isreal is_nonzero is_same_size isin bucketize searchsorted
""")
REDUCE = _words("""
sum mean nansum nanmean prod std var std_mean var_mean max min amax amin aminmax argmax argmin all any norm logsumexp
median nanmedian mode cumsum cumprod cummax cummin logcumsumexp count_nonzero dist quantile nanquantile trace diff
unique unique_consecutive sort argsort msort topk kthvalue renorm histc bincount cov corrcoef
""")
LINALG = _words("""
matmul mm bmm mv dot vdot inner outer ger kron addmm addbmm baddbmm addmv addr cross det logdet slogdet inverse
pinverse matrix_power matrix_exp einsum tensordot cdist chain_matmul cosine_similarity pairwise_distance
""")
SHAPE = _words("""
reshape view view_as reshape_as flatten unflatten ravel squeeze unsqueeze transpose swapaxes swapdims permute movedim
moveaxis t adjoint narrow select index_select masked_select gather take take_along_dim chunk split tensor_split hsplit
vsplit dsplit unbind flip fliplr flipud roll rot90 tile repeat repeat_interleave expand expand_as broadcast_to diag
diagonal diag_embed diagflat tril triu nonzero argwhere scatter scatter_add scatter_reduce index_add index_copy
index_fill index_put masked_fill masked_scatter unfold clone detach contiguous sum_to_size select_scatter
slice_scatter diagonal_scatter cat concat concatenate stack hstack vstack dstack column_stack row_stack meshgrid
broadcast_tensors atleast_1d atleast_2d atleast_3d block_diag cartesian_prod combinations tril_indices triu_indices
""")
CONVERT = _words("""
float double half bfloat16 int long short bool byte char cfloat cdouble to type_as cpu cuda item tolist size dim
ndimension numel nelement element_size stride is_floating_point is_complex is_signed is_contiguous bernoulli
multinomial normal
""")
# in-place forms (`x.add_(1)`, `x.zero_()`): they only ever touch the caller's private copies
IN_PLACE = _words("""
abs_ absolute_ acos_ acosh_ add_ addcdiv_ addcmul_ arccos_ arccosh_ arcsin_ arcsinh_ arctan2_ arctan_ arctanh_
asin_ asinh_ atan2_ atan_ atanh_ bernoulli_ bitwise_and_ bitwise_left_shift_ bitwise_not_ bitwise_or_
bitwise_right_shift_ bitwise_xor_ ceil_ clamp_ clamp_max_ clamp_min_ clip_ conj_physical_ copy_ copysign_ cos_
cosh_ cumprod_ cumsum_ deg2rad_ digamma_ div_ divide_ eq_ erf_ erfc_ erfinv_ exp2_ exp_ expm1_ exponential_ fill_
fill_diagonal_ fix_ float_power_ floor_ floor_divide_ fmod_ frac_ gcd_ ge_ greater_ greater_equal_ gt_ heaviside_
hypot_ i0_ igamma_ igammac_ index_add_ index_copy_ index_fill_ index_put_ lcm_ ldexp_ le_ lerp_ less_ less_equal_
lgamma_ log10_ log1p_ log2_ log_ logical_and_ logical_not_ logical_or_ logical_xor_ logit_ lt_ masked_fill_
masked_scatter_ mul_ multiply_ mvlgamma_ nan_to_num_ ne_ neg_ negative_ nextafter_ normal_ not_equal_ polygamma_
pow_ put_ rad2deg_ random_ reciprocal_ relu_ remainder_ renorm_ round_ rsqrt_ scatter_ scatter_add_
scatter_reduce_ sgn_ sigmoid_ sign_ sin_ sinc_ sinh_ sqrt_ square_ squeeze_ sub_ subtract_ swapaxes_ swapdims_ t_
tan_ tanh_ transpose_ tril_ triu_ true_divide_ trunc_ uniform_ unsqueeze_ xlogy_ zero_
""")
TENSOR_PROPERTIES = _words("""
shape dtype device ndim T mT H mH real imag is_cuda is_cpu layout requires_grad is_leaf itemsize nbytes
""")
_UNARY_OPERATORS = _words("""
__getitem__ __setitem__ __len__ __iter__ __contains__ __bool__ __float__ __int__ __index__ __complex__ __format__
__repr__ __reversed__ __neg__ __pos__ __abs__ __invert__ __round__ __floor__ __ceil__ __trunc__
__eq__ __ne__ __lt__ __le__ __gt__ __ge__
""")
_BINARY_OPERATORS = "add sub mul truediv floordiv mod pow matmul and or xor lshift rshift div"
# operators: `x[i]`, `-x`, `x == y`, and `x + y`, `y + x`, `x += y` for every binary operator above
OPERATORS = _UNARY_OPERATORS | frozenset(f"__{kind}{op}__" for op in _BINARY_OPERATORS.split()
                                         for kind in ("", "r", "i"))
# creation: zero-filled or defined memory only (nothing uninitialised: no empty*, new_empty, torch.Tensor(n)),
# each measured on the meta device against MAX_TENSOR_BYTES before it is made
CREATORS = _words("""
zeros ones full rand randn randint randperm eye arange linspace logspace tensor as_tensor zeros_like ones_like
full_like rand_like randn_like randint_like
""")
TENSOR_CREATORS = _words("new_zeros new_ones new_full new_tensor")
_TORCH_ONLY = _words("""
is_tensor numel get_default_dtype result_type promote_types can_cast broadcast_shapes layer_norm group_norm dropout
""")

# the functions of each allowed module
TORCH_FUNCTIONS = ELEMENTWISE | COMPARE | REDUCE | LINALG | SHAPE | CONVERT | CREATORS | _TORCH_ONLY
TENSOR_METHODS = ELEMENTWISE | COMPARE | REDUCE | LINALG | SHAPE | CONVERT | IN_PLACE | TENSOR_CREATORS | OPERATORS
FUNCTIONAL = _words("""
adaptive_avg_pool1d adaptive_avg_pool2d adaptive_max_pool1d adaptive_max_pool2d avg_pool1d avg_pool2d batch_norm
bilinear binary_cross_entropy binary_cross_entropy_with_logits celu conv1d conv2d cosine_embedding_loss
cosine_similarity cross_entropy dropout elu embedding gelu glu group_norm gumbel_softmax hardsigmoid hardswish
hardtanh huber_loss instance_norm kl_div l1_loss layer_norm leaky_relu linear log_softmax logsigmoid max_pool1d
max_pool2d mish mse_loss nll_loss normalize one_hot pad pairwise_distance pdist prelu relu relu6 rms_norm selu
sigmoid silu smooth_l1_loss softmax softmin softplus softshrink softsign tanh tanhshrink threshold
scaled_dot_product_attention
""")
LINALG_FUNCTIONS = _words("""
norm vector_norm matrix_norm det slogdet inv pinv svd svdvals eig eigh eigvals eigvalsh qr cholesky solve lstsq
matrix_rank matrix_power matrix_exp cross vecdot multi_dot diagonal cond
""")
FFT_FUNCTIONS = _words("fft ifft rfft irfft fft2 ifft2 rfft2 irfft2 fftn ifftn rfftn irfftn fftfreq rfftfreq fftshift "
                       "ifftshift")
SPECIAL_FUNCTIONS = _words("""
erf erfc erfinv expit logit logsumexp softmax log_softmax gammaln digamma psi entr sinc xlogy xlog1py i0 i0e i1 i1e
log1p expm1 exp2 round ndtr ndtri log_ndtr
""")
# torch values that are not operations (torch.Tensor is an isinstance() check only: calling it or reading its
# attributes is refused)
TORCH_VALUES = _words("Size dtype finfo iinfo no_grad device inf nan pi e Tensor")
TORCH_DTYPES = _words("""
float32 float64 float16 bfloat16 int64 int32 int16 int8 uint8 bool complex64 complex128 float double half int long
short cfloat cdouble
""")
TORCH_SUBMODULES = _words("nn functional linalg fft special autograd")   # torch.nn holds only functional
# every public name of math (pure functions on numbers, and constants)
MATH_NAMES = _words("""
acos acosh asin asinh atan atan2 atanh cbrt ceil comb copysign cos cosh degrees dist e erf erfc exp exp2 expm1 fabs
factorial floor fmod frexp fsum gamma gcd hypot inf isclose isfinite isinf isnan isqrt lcm ldexp lgamma log log10
log1p log2 modf nan nextafter perm pi pow prod radians remainder sin sinh sqrt tan tanh tau trunc ulp
""")
# --------------------------------------------------------------------------- gradients
# Submitted code may take gradients (see sandbox/gradients.py): `torch.autograd.grad(outputs, inputs)` on the
# tensors it holds, `await m.backward(loss)` and the `.grad` points of the model (`await m.x.output.grad`,
# `m.x.output.grad = g`). Every backward runs with the graph retained (it is shared with the batch-mates),
# accumulates into no parameter, counts on the request's compute budget, and resumes only the gradient points
# of the request that started it. `x.grad` of a tensor and `x.backward()` stay refused (PrivateTensor refuses
# both operations); higher-order gradients (create_graph=True) are refused. Requests whose source names one
# of GRADIENT_NAMES run in forward passes with autograd on, batched only with each other.
AUTOGRAD_FUNCTIONS = _words("grad")
# what a session (serve/jobs/sessions.py: an `async def sweep(model)` run on the server) calls on its model
SESSION_NAMES = _words("atrace agenerate token_id to_tokens")
GRADIENT_NAMES = _words("grad backward autograd")

ASYNCINTERP_ERRORS = _words("MissedHookPoint OutOfOrderError ReplacementError UnsetFutureError AsyncInterpError "
                            "RunStopped")
ASYNCINTERP_NAMES = _words("gather spawn Future emit serve") | ASYNCINTERP_ERRORS   # `serve` holds only emit
SERVE_NAMES = _words("emit")

# operations that read without allocating (no size check before they run)
NO_ALLOC = TENSOR_PROPERTIES | _words("""
size dim ndimension numel nelement element_size stride is_floating_point is_complex is_signed is_contiguous item
tolist __len__ __bool__ __float__ __int__ __index__ __complex__ __format__ __repr__ is_nonzero is_same_size
__contains__ equal allclose
""")
# the result has the shape and dtype of the tensor it is called on (or is a view of it): no larger than it, so
# the size check needs no run on meta tensors when that tensor is within the cap and no dtype is asked for
SIZE_KEEPING = _words("clone detach contiguous softmax log_softmax neg abs exp log sqrt tanh sigmoid relu")
# output size depends on the data (no meta kernel): checked by rule before running, or bounded by the input
DATA_DEPENDENT = _words("bincount repeat_interleave nonzero argwhere masked_select unique unique_consecutive")
# index tensors must lie inside the indexed dimension (GPU kernels do not check: a device assert kills every request)
INDEX_CHECKED = _words("""
gather scatter scatter_ scatter_add scatter_add_ scatter_reduce scatter_reduce_ index_select index_add index_add_
index_copy index_copy_ index_fill index_fill_ take_along_dim take put_
""")

# --------------------------------------------------------------------------- builtins
BUILTINS = _words("""
abs all any bin bool bytes callable chr complex dict divmod enumerate filter float frozenset hex int isinstance
issubclass iter len list map max min next oct ord pow reversed round set slice sorted str sum tuple zip
ArithmeticError AssertionError AttributeError Exception IndexError KeyError LookupError NotImplementedError
RuntimeError StopAsyncIteration StopIteration TypeError ValueError ZeroDivisionError OverflowError True False None
""")
# builtins replaced by a restricted version
REPLACED_BUILTINS = {
    "range": f"at most MAX_RANGE ({MAX_RANGE}) items",
    "print": "does nothing",
    "repr": "only of values whose text shows no memory address (TEXT_SAFE_TYPES and containers of them)",
    "ascii": "as repr",
    "__import__": "only ALLOWED_MODULES, as proxies holding the names listed above",
}
# builtins refused by name before running, with the reason (a name the source binds itself is its own)
REFUSED_BUILTINS = {
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
# values submitted code may turn into text (str, repr, f-strings, %): their text shows no memory address; the
# model's envoys and hook points, tensors, and lists/tuples/sets/dicts/exceptions of these too
TEXT_SAFE_TYPES = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, torch.Size, slice,
                   range, torch.finfo, torch.iinfo)

# --------------------------------------------------------------------------- the model
# The model reaches submitted code as a restricted envoy: submodules (by their names in the model), standard
# names (layers, attn, mlp, ...), hook points (output, input, inputs, semantic points such as resid_pre, and
# any point the envoy's class declares), and these; not the nn.Module, its parameters, buffers or methods.
# What the model hands submitted code (awaited values, gather/spawn results, ad-hoc call results, m.generated) is
# a private copy of the request's own rows: tensors (PrivateTensor), numbers, strings, and tuples/lists/dicts of
# them (dicts with attribute access for the OUTPUT_FIELDS); any other object, the KV cache first, becomes None.
# (A copy on the CPU may share memory with the model until either side writes, copy-on-write, where that memory
# is at most twice the rows it shows: never reachable but through the raw-storage operations refused below.)
# What goes into the model (assignment, replace/set, skip, in-place edits of those copies) must be a tensor with
# the shape, dtype and device of the value it replaces, and finite. What leaves (the result, emit) may only be
# tensors, numbers, strings, bytes and containers of them.
ENVOY_ATTRIBUTES = _words("path skip at")     # at("blocks.3.hook_resid_post"): the same walk, part by part
ROOT_ATTRIBUTES = _words("steps stop generated backward",     # the model itself only
                         "decode to_tokens token_id")  # a language model's tokenizer, text <-> ids only
POINT_ATTRIBUTES = _words("replace set grad")        # a hook point: await it, or replace / set it; its gradient

# --------------------------------------------------------------------------- attribute names
# names that are refused anywhere, even where a list would allow them (as every PRIVATE_ATTRIBUTE name is)
REFUSED_ATTRIBUTES = frozenset({
    # string formatting walks attributes by name ("{0.__class__}".format(x))
    "format", "format_map",
    # files, processes, shared memory, raw storage, escaping the invoke's rows
    "numpy", "tofile", "dump", "dumps", "save", "load", "from_file", "to_dlpack", "share_memory_",
    "storage", "untyped_storage", "storage_offset", "data_ptr", "as_strided", "as_strided_", "set_",
    "resize_", "resize_as_", "pin_memory", "mro", "register_hook", "register_post_accumulate_grad_hook",
    "grad_fn", "requires_grad_", "module", "envoy",
    # introspection of frames, code, generators, functions
    "gi_frame", "gi_code", "gi_yieldfrom", "cr_frame", "cr_code", "cr_await", "ag_frame", "ag_code", "ag_await",
    "f_globals", "f_locals", "f_builtins", "f_back", "f_code", "tb_frame", "tb_next", "co_code", "func_globals",
    "with_traceback",
    # modules hanging off allowed modules (torch.os, torch.hub, ...)
    "os", "sys", "subprocess", "socket", "shutil", "builtins", "importlib", "ctypes", "pathlib", "io", "pickle",
    "marshal", "multiprocessing", "threading", "signal", "hub", "jit", "ops", "classes", "library",
    "distributed", "serialization", "package", "utils", "cpp_extension", "system", "popen",
})
# methods and fields of the Python values submitted code holds (str, bytes, list, dict, tuple, set, int, float,
# complex, range, slice, exceptions)
PYTHON_VALUE_ATTRIBUTES = _words("""
add add_note append args as_integer_ratio bit_count bit_length capitalize casefold center clear conjugate copy
count decode denominator difference difference_update discard encode endswith expandtabs extend find from_bytes
fromhex fromkeys get hex imag index indices insert intersection intersection_update is_integer isalnum isalpha
isascii isdecimal isdigit isdisjoint isidentifier islower isnumeric isprintable isspace issubset issuperset istitle
isupper items join keys ljust lower lstrip maketrans numerator partition pop popitem real remove removeprefix
removesuffix replace reverse rfind rindex rjust rpartition rsplit rstrip setdefault sort split splitlines start
startswith step stop strip swapcase symmetric_difference symmetric_difference_update title to_bytes translate union
update upper values zfill
""")
# fields of torch's named results (topk -> values, indices; slogdet -> sign, logabsdet; qr -> Q, R; ...)
RESULT_FIELDS = _words("""
values indices sign logabsdet Q R L U S V Vh eigenvalues eigenvectors mantissa exponent solution residuals rank
singular_values info
""")
FINFO_FIELDS = _words("bits eps max min resolution smallest_normal tiny dtype")   # torch.finfo / torch.iinfo
# fields of model outputs (dicts with attribute access; other keys by item: out["key"]) and of m.generated
OUTPUT_FIELDS = _words("logits tokens text hidden_states last_hidden_state attentions past_key_values loss")
# ai.Future and what `await ai.spawn(...)` gives
TASK_METHODS = _words("done cancel result exception set_result set_exception name")

# THE RULE for `x.name` in submitted source:
# * names starting with PRIVATE_ATTRIBUTE, and REFUSED_ATTRIBUTES: refused at submission;
# * ALLOWED_ATTRIBUTES: allowed on any object (tensors and proxies still check each operation when it runs);
# * a torch operation outside ALLOWED_ATTRIBUTES (a name torch.Tensor or torch has): refused at submission;
# * any other name may only be read from the model (its envoys and hook points, which answer only with what the
#   paragraph "the model" above lists): the read is checked when it runs and refused on any other object.
# `from module import name` takes only names on ALLOWED_ATTRIBUTES (the module's proxy then holds it or not).
# Assignment `x.name = value` is allowed for ASSIGNABLE_POINTS of the model only; deletion never.
ALLOWED_ATTRIBUTES = frozenset(name for name in (
    TENSOR_METHODS | TENSOR_PROPERTIES | TORCH_FUNCTIONS | FUNCTIONAL | LINALG_FUNCTIONS | FFT_FUNCTIONS
    | SPECIAL_FUNCTIONS | TORCH_VALUES | TORCH_DTYPES | TORCH_SUBMODULES | MATH_NAMES | ASYNCINTERP_NAMES
    | PYTHON_VALUE_ATTRIBUTES | RESULT_FIELDS | FINFO_FIELDS | OUTPUT_FIELDS | TASK_METHODS | GRADIENT_NAMES
    | SESSION_NAMES
) if not name.startswith(PRIVATE_ATTRIBUTE)) - REFUSED_ATTRIBUTES     # operators (__add__) are private in source
