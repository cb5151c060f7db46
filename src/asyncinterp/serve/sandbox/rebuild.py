"""Rebuild: a captured description (:mod:`.capture`) back into callables, through a compile function the caller picks.

The description is untrusted data: every field is checked before anything
is compiled (its format first, then types, names, indices, nesting), and a
"function" whose source is not one plain ``def``/``async def`` of that name
is refused (:class:`DescriptionRefused`, a :class:`~.wire.WireError`).

Each function is compiled on its own, by ``compile_source(source, filename,
namespace)``, into a fresh namespace that already holds what it read when it
was captured: values (tensors decoded fresh from bytes: private copies),
futures (one new :class:`~asyncinterp.Future` per captured one, shared as
they were), and, after every function is compiled, the helpers it calls.
Modules are re-imported by name: an ``import torch as torch`` line is put
before the source, so that the compile function checks and resolves them
like any import (the sandbox hands out its proxy modules).

**Closure variables become globals of that namespace.** The captured source
is a top-level ``def``, so the names it read from an enclosing function are
free names there, read from the namespace: for reads the semantics are the
same. Writes (``nonlocal``) are refused at capture time.

Compile functions: :func:`trusted` (plain ``compile``/``exec``: only for
code you wrote, e.g. a dry run of your own job) and :func:`checked` (the
sandbox's static check of submitted code, :func:`~.sandbox.check_source`,
then as :func:`trusted`: what :func:`~.dryrun.dry_run` uses to find what a
server would refuse).
"""

from __future__ import annotations

import ast
import functools
import platform

import torch

from ...hooks.modules import submodules
from ...kernel.futures import Future
from ...client.capture import FORMAT, MAX_VALUE_DEPTH, version
from .checker import AST_LOCK, check_source
from ...client import policy
from ...client.policy import ALLOWED_MODULES
from ...lru import LRU
from .source_lines import job_filename, job_token, remember
from ...client.wire import DescriptionRefused, WireError  # noqa: F401 - DescriptionRefused: a wire error (its home)

__all__ = ["MAX_FUNCTIONS", "MAX_LINE", "MAX_SOURCE_TOTAL", "DescriptionRefused", "DescriptionTooLarge", "check_size",
           "checked", "intervention", "rebuild", "resolve", "trusted"]


class DescriptionTooLarge(DescriptionRefused):
    """A captured description is over a size or count limit (a server answers 413, naming the limit)."""


#: the most functions, characters of source (all functions together) and the highest line a job's capture may have
MAX_FUNCTIONS = 256
MAX_SOURCE_TOTAL = 256 * 1024
MAX_LINE = 100_000


def trusted(source: str, filename: str, namespace: dict) -> None:
    """Compile and run ``source`` into ``namespace`` as it is (only for code you trust: your own)."""
    with AST_LOCK:
        code = compile(source, filename, "exec")
    exec(code, namespace)  # noqa: S102 - the caller vouches for the source


def checked(source: str, filename: str, namespace: dict) -> None:
    """The sandbox's static check of submitted code (raises ``SandboxRefused``), then :func:`trusted`."""
    check_source(source)
    trusted(source, filename, namespace)


def rebuild(description, compile_source) -> list:
    """The functions of ``description``, in its order (index ``i`` is ``description["functions"][i]``)."""
    body = _check_header(description)
    tensors = _list(body, "tensors")
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise DescriptionRefused(f"the tensor table holds a {type(t).__name__}, not a tensor")
    futures = [Future(_name(n, allow_none=True)) for n in _list(body, "futures")]
    reader = _Reader(tensors, futures, getattr(compile_source, "envoy", None))
    entries = _list(body, "functions")
    check_size(body)
    token = job_token()     # the file names of this job's sources are the server's, never the client's
    spaces, built = [], []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise DescriptionRefused(f"function {i} of the description is not a map")
        name = _name(entry.get("name"))
        source = _function_source(entry.get("source"), name, body.get("python"))
        line = entry.get("line")
        if type(line) is not int or not 1 <= line <= MAX_LINE:
            raise DescriptionRefused(f"function {name}: line {line!r} is not a line number (1 to {MAX_LINE})")
        namespace = {"__name__": "captured"}
        for var, value in _map(entry, "values").items():
            namespace[_name(var)] = reader.value(value, 0)
        for var, index in _map(entry, "futures").items():
            namespace[_name(var)] = futures[_index(index, futures, "future")]
        imports = []
        for var, module in _map(entry, "modules").items():
            if module not in ALLOWED_MODULES:
                raise DescriptionRefused(f"function {name}: module {module!r} is not allowed")
            imports.append(f"import {module} as {_name(var)}")
        filename = job_filename("captured", name, str(entry.get("file")), token)
        text = _placed(source, "; ".join(imports), line)
        compile_source(text, filename, namespace)
        remember(filename, text)
        fn = namespace.get(name)
        if not callable(fn):
            raise DescriptionRefused(f"function {name}: its source does not define {name}")
        _set_defaults(fn, entry, reader, getattr(compile_source, "private", None))
        spaces.append(namespace)
        built.append(fn)
    for entry, namespace in zip(entries, spaces):   # helpers last: cycles (f calls g calls f) are fine
        for var, index in _map(entry, "functions").items():
            namespace[_name(var)] = built[_index(index, built, "function")]
    return _Built(built, reader)


def resolve(model, path: str):
    """The envoy of ``model``'s module at ``path`` (``""``: the model), only through submodule names."""
    envoy = model
    for part in path.split(".") if path else ():
        if part not in submodules(envoy.module):
            raise DescriptionRefused(f"the model has no module {path!r} (a captured reference names it)")
        envoy = envoy.child(part)
    return envoy


def _set_defaults(fn, entry, reader, private) -> None:
    """The captured parameter defaults of ``fn`` (its source carries ``None`` in their place)."""
    defaults, kwdefaults = entry.get("defaults"), entry.get("kwdefaults")
    if defaults is None and kwdefaults is None:
        return
    own = private or (lambda v: v)
    if defaults is not None:
        if not isinstance(defaults, (list, tuple)) or len(defaults) != len(fn.__defaults__ or ()):
            raise DescriptionRefused(f"function {entry.get('name')}: its defaults do not match its parameters")
        fn.__defaults__ = tuple(own(reader.value(v, 0)) for v in defaults)
    if kwdefaults is not None:
        if not isinstance(kwdefaults, dict) or set(kwdefaults) != set(fn.__kwdefaults__ or ()):
            raise DescriptionRefused(f"function {entry.get('name')}: its keyword defaults do not match its "
                                     "parameters")
        fn.__kwdefaults__ = {k: own(reader.value(v, 0)) for k, v in kwdefaults.items()}


class _Built(list):
    """The rebuilt functions, in order, and the reader of their description's values (for partials' keywords)."""

    def __init__(self, functions, reader):
        super().__init__(functions)
        self.reader = reader


def intervention(built: list, spec, description) -> object:
    """One intervention of a job: the function ``spec["function"]`` of ``built``, with its keywords bound."""
    if not isinstance(spec, dict):
        raise DescriptionRefused("an intervention of the job is not a map")
    fn = built[_index(spec.get("function"), built, "function")]
    reader = getattr(built, "reader", None) or _Reader(_list(description, "tensors"), [])
    params = {_name(k): reader.value(v, 0) for k, v in _map(spec, "keywords").items()}
    return functools.partial(fn, **params) if params else fn


# ----------------------------------------------------------------------- checks of untrusted fields
def check_size(description) -> None:
    """Bounded work before anything is parsed or compiled: a capture's functions and their source, counted."""
    entries = _list(description, "functions") if isinstance(description, dict) else []
    if len(entries) > MAX_FUNCTIONS:
        raise DescriptionTooLarge(f"this job captures {len(entries)} functions; a server rebuilds at most "
                                  f"{MAX_FUNCTIONS} per job (the limit on captured functions)")
    chars = sum(len(e.get("source")) for e in entries if isinstance(e, dict) and isinstance(e.get("source"), str))
    if chars > MAX_SOURCE_TOTAL:
        raise DescriptionTooLarge(f"this job captures {chars} characters of source; a server rebuilds at most "
                                  f"{MAX_SOURCE_TOTAL} per job (the limit on captured source)")


def _check_header(body) -> dict:
    if not isinstance(body, dict):
        raise DescriptionRefused(f"a captured description is a map, got {type(body).__name__}")
    found = body.get("format")
    if found != FORMAT:
        raise DescriptionRefused(
            f"this captured description has format {found!r} (written by asyncinterp {body.get('asyncinterp')!r} "
            f"on Python {body.get('python')!r}); this side (asyncinterp {version()}) reads format {FORMAT} only: "
            "use the same asyncinterp version on both sides")
    return body


def _name(value, allow_none=False):
    if value is None and allow_none:
        return None
    if not isinstance(value, str) or not value.isidentifier() or value.startswith("__") or len(value) > 200:
        raise DescriptionRefused(f"{value!r:.80} is not a name a captured function may use")
    return value


def _index(value, table, what) -> int:
    if type(value) is not int or not 0 <= value < len(table):
        raise DescriptionRefused(f"{what} index {value!r:.40} is out of range (there are {len(table)})")
    return value


def _list(obj, key) -> list:
    value = obj.get(key) if isinstance(obj, dict) else None
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise DescriptionRefused(f"{key!r} of a captured description must be a list")
    return list(value)


def _map(obj, key) -> dict:
    value = obj.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise DescriptionRefused(f"{key!r} of a captured function must be a map")
    return value


def _function_source(source, name, client_python) -> str:
    if not isinstance(source, str):
        raise DescriptionRefused(f"function {name}: its source is not text")
    if _PLAIN_DEFS.get((source, name)):   # checked before (a sweep sends the same function again and again)
        return source
    try:
        with AST_LOCK:
            tree = ast.parse(source)
    except SyntaxError as exc:
        raise DescriptionRefused(
            f"function {name}: its source does not parse here ({exc.msg}, line {exc.lineno}; written on Python "
            f"{str(client_python)[:20]}, read on Python {platform.python_version()}): use syntax both "
            "versions know") from None
    except (ValueError, RecursionError, MemoryError):
        raise DescriptionRefused(f"function {name}: its source cannot be parsed") from None
    node = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name != name or node.decorator_list:
        raise DescriptionRefused(f"function {name}: its source is not one plain `def {name}` or "
                                 f"`async def {name}` statement")
    _PLAIN_DEFS.put((source, name), True)
    return source


# sources (with their function's name) found to be one plain def: what a refused one is, is found again
_PLAIN_DEFS = LRU(policy.PROGRAM_CACHE_SIZE, max_weight=16 << 20, weigh=lambda key, _: len(key[0]))


def _placed(source: str, imports: str, line: int) -> str:
    """``source`` at its original line (tracebacks name the user's lines), after the import line if any."""
    if not imports:
        return "\n" * (line - 1) + source
    return imports + "\n" * max(line - 1, 1) + source


class _Reader:
    """Captured values back from their tagged form (:meth:`.capture.Capture._value`)."""

    def __init__(self, tensors, futures, envoy=None):
        self.tensors = tensors
        self.futures = futures
        self.envoy = envoy     # path -> the model's module there (a reference to the model), if any

    def value(self, item, depth):
        if depth > MAX_VALUE_DEPTH:
            raise DescriptionRefused(f"a captured value nests deeper than {MAX_VALUE_DEPTH} levels")
        if not isinstance(item, (list, tuple)) or len(item) != 2 or not isinstance(item[0], str):
            raise DescriptionRefused(f"{item!r:.80} is not a captured value")
        tag, payload = item
        if tag == "=":
            if payload is not None and type(payload) not in (bool, int, float, str, bytes):
                raise DescriptionRefused(f"a captured scalar is a {type(payload).__name__}")
            return payload
        if tag == "R":
            return self.tensors[_index(payload, self.tensors, "tensor")]
        if tag == "U":
            return self.futures[_index(payload, self.futures, "future")]
        if tag == "E":
            if self.envoy is None:
                raise DescriptionRefused(f"a captured value refers to the model's module {payload!r:.80}; rebuild "
                                         "it with a compile function that knows the model (its `envoy(path)`)")
            if not isinstance(payload, str) or len(payload) > 1000:
                raise DescriptionRefused("a reference to the model is not a module path")
            return self.envoy(payload)
        if not isinstance(payload, (list, tuple)):
            raise DescriptionRefused(f"a captured {tag!r} value holds no list")
        try:
            if tag == "D":
                return {self.value(k, depth + 1): self.value(v, depth + 1) for k, v in (_pair(p) for p in payload)}
            items = [self.value(v, depth + 1) for v in payload]
            if tag == "L":
                return items
            if tag == "T":
                return tuple(items)
            if tag == "S":
                return set(items)
            if tag == "Z":
                return frozenset(items)
        except TypeError as exc:   # e.g. a list as a dict key or set item
            raise DescriptionRefused(f"a captured {tag!r} value cannot be rebuilt ({exc})") from None
        raise DescriptionRefused(f"unknown captured value tag {tag!r:.20}")


def _pair(p):
    if not isinstance(p, (list, tuple)) or len(p) != 2:
        raise DescriptionRefused("a captured dict item is not a [key, value] pair")
    return p
