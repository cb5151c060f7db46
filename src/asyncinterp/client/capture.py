"""Capture: an intervention function as a description that can travel (source + what it reads), never pickled.

"Remote is local" (docs/remote.md): a function written for a local run must
run unchanged where the model is. A function object cannot travel (its
bytecode is tied to one Python version, and unpickling is running arbitrary
code), so :class:`Capture` describes it instead:

* its **source** (``inspect.getsource``, dedented; notebook cells work when
  the source is available);
* every **value** it reads from closure cells and globals (the code object's
  free variables and its ``LOAD_GLOBAL`` names, nested code included):
  tensors, numbers, strings, bytes, ``None``, and lists, tuples, dicts and
  sets of these; each tensor once, in a table by identity;
* the **functions** it calls (helpers), as source, recursively, cycle-safe;
* the :class:`~asyncinterp.Future` s it shares with other functions, by
  identity: one future here is one future on the other side;
* the **modules** it uses (``torch``, ``math``, ``asyncinterp as ai``), by
  name only, when the sandbox policy allows them;
* the model and its modules (envoys), by reference: their path, resolved
  on the model of the side that runs the job;
* builtins are not captured (the other side has its own).

Anything else is a ``TypeError`` here, on the client, naming the variable,
its type, the function and the line that reads it. The description is plain
data (strings, numbers, lists, maps, tensors) for :mod:`.wire`; it carries
:data:`FORMAT` and the writer's asyncinterp and Python versions so that a
reader can refuse what it does not understand (:mod:`.rebuild`).
"""

from __future__ import annotations

import ast
import dis
import functools
import inspect
import platform
import types

import torch

from ..hooks.envoy import Envoy
from ..kernel.futures import Future
from .policy import ALLOWED_MODULES
from .sources import parsed_source

__all__ = ["FORMAT", "MAX_VALUE_DEPTH", "Capture", "describe", "version"]

#: the version of a description's layout; a reader refuses any other
FORMAT = 1
#: how deeply captured values may nest (lists in lists ...), on both sides
MAX_VALUE_DEPTH = 16

_SCALARS = (type(None), bool, int, float, str, bytes)
_LOADS = frozenset(("LOAD_GLOBAL", "LOAD_NAME"))
_CELL_STORES = frozenset(("STORE_DEREF", "DELETE_DEREF"))


def version() -> str:
    """This side's asyncinterp version."""
    from .. import __version__
    return __version__


class Capture:
    """Functions described one by one into shared tables (one tensor, future, helper: one entry).

    ``add(fn)`` returns the function's index in :attr:`functions`; :meth:`description`
    is the whole as plain data. One :class:`Capture` per job, so that what two
    invokes share is shared on the other side too.
    """

    def __init__(self):
        self.functions = []     # one description per function, by index
        self.tensors = []       # each tensor once
        self.futures = []       # each future once (its name, or None)
        self._function_ids = {}  # id(function) -> index
        self._tensor_ids = {}
        self._future_ids = {}
        self._kept = []         # what the id tables refer to, alive while capturing

    def add(self, fn) -> int:
        """Describe ``fn`` (and, recursively, the helpers it calls); its index in :attr:`functions`."""
        index = self._function_ids.get(id(fn))
        if index is not None:
            return index
        if type(fn) is not types.FunctionType:
            raise TypeError(f"{fn!r} ({type(fn).__name__}) cannot travel: only functions defined with `def` or "
                            "`async def` travel, as source")
        index = self._function_ids[id(fn)] = len(self.functions)
        self._kept.append(fn)
        entry = {"name": fn.__name__, "source": _source(fn), "line": fn.__code__.co_firstlineno,
                 "file": fn.__code__.co_filename, "values": {}, "functions": {}, "modules": {}, "futures": {}}
        if fn.__defaults__ or fn.__kwdefaults__:   # values, like the rest: `async def f(m, i=i)` travels
            entry["source"] = _without_defaults(entry["source"])
            entry["defaults"] = [self._value(v, fn, f"(default {i})", 0) for i, v in enumerate(fn.__defaults__ or ())]
            entry["kwdefaults"] = {k: self._value(v, fn, k, 0) for k, v in (fn.__kwdefaults__ or {}).items()}
        self.functions.append(entry)
        _refuse_cell_writes(fn)
        for name, value in _reads(fn):
            self._bind(entry, fn, name, value)
        return index

    def add_intervention(self, intervention) -> dict:
        """The wire form of one intervention: its function's index and a partial's keywords (captured values)."""
        fn, bound = partial_parts(intervention)
        index = self.add(fn)
        keywords = {key: self._value(value, fn, key, 0) for key, value in bound.items()}
        return {"function": index, "keywords": keywords}

    def description(self) -> dict:
        """The captured functions and their tables, with the format and versions (plain data for the wire)."""
        return {"format": FORMAT, "asyncinterp": version(), "python": platform.python_version(),
                "functions": self.functions, "tensors": self.tensors, "futures": self.futures}

    # ------------------------------------------------------------------ one name a function reads
    def _bind(self, entry, fn, name, value):
        if name.startswith("__"):
            raise _cannot(fn, name, value, "names starting with `__` belong to the module it was defined in "
                                           "(and the sandbox refuses them)")
        if isinstance(value, types.ModuleType):
            if value.__name__ not in ALLOWED_MODULES:
                raise _cannot(fn, name, value, f"module {value.__name__!r} is not one the server allows "
                                               f"({', '.join(ALLOWED_MODULES)}); do this work before the trace "
                                               "and capture its result instead")
            entry["modules"][name] = value.__name__
        elif type(value) is types.FunctionType:
            entry["functions"][name] = self.add(value)
        elif isinstance(value, Future):
            entry["futures"][name] = self._future(value)
        else:
            entry["values"][name] = self._value(value, fn, name, 0)

    def _value(self, value, fn, name, depth):
        if depth > MAX_VALUE_DEPTH:
            raise _cannot(fn, name, value, f"it nests more than {MAX_VALUE_DEPTH} levels deep")
        if isinstance(value, _SCALARS) and type(value) in _SCALARS:
            return ["=", value]
        if isinstance(value, torch.Tensor):
            if type(value) is not torch.Tensor and type(value) is not torch.nn.Parameter:
                raise _cannot(fn, name, value, "only plain tensors travel")
            index = self._tensor_ids.get(id(value))
            if index is None:
                index = self._tensor_ids[id(value)] = len(self.tensors)
                self.tensors.append(value.detach())
                self._kept.append(value)
            return ["R", index]
        if isinstance(value, Future):
            return ["U", self._future(value)]
        if isinstance(value, Envoy) or getattr(type(value), "travels_as_model", False):
            # the model or one of its modules (or ai.remote's model): by reference, resolved where it runs
            if getattr(value, "attached", False):
                raise _cannot(fn, name, value, "an attached module does not travel; attach it on the server")
            return ["E", value.path]
        tag = _CONTAINERS.get(type(value))
        if tag is None:
            raise _cannot(fn, name, value, "only tensors, numbers, strings, bytes, None, ai.Future and lists, "
                                           "tuples, dicts and sets of these travel")
        if tag == "D":
            return ["D", [[self._value(k, fn, name, depth + 1), self._value(v, fn, name, depth + 1)]
                          for k, v in value.items()]]
        return [tag, [self._value(v, fn, name, depth + 1) for v in value]]

    def _future(self, future) -> int:
        index = self._future_ids.get(id(future))
        if index is None:
            index = self._future_ids[id(future)] = len(self.futures)
            self.futures.append(future.name if isinstance(future.name, str) else None)
            self._kept.append(future)
        return index


_CONTAINERS = {list: "L", tuple: "T", dict: "D", set: "S", frozenset: "Z"}


def describe(fn) -> dict:
    """The description of one function (``functions[0]`` is ``fn``; see :class:`Capture`)."""
    capture = Capture()
    capture.add(fn)
    return capture.description()


# ----------------------------------------------------------------------- reading a function
def _source(fn) -> str:
    name = fn.__qualname__
    if fn.__name__ == "<lambda>":
        raise TypeError(f"a lambda ({fn.__code__.co_filename}, line {fn.__code__.co_firstlineno}) cannot travel "
                        "as source; write it as a named `def` or `async def`")
    try:
        source, tree = parsed_source(fn)
    except (OSError, TypeError) as exc:
        raise TypeError(f"cannot get the source of {name} to send it ({exc}); define it in a file or a "
                        "notebook cell (not in an interactive `python` prompt or through exec)") from None
    except SyntaxError as exc:
        raise TypeError(f"the source of {name} does not parse on its own ({exc.msg}); define it as a plain "
                        "`def`/`async def` statement") from None
    node = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name != fn.__name__:
        raise TypeError(f"the source of {name} is not one function definition; define it as a plain "
                        "`def`/`async def` statement")
    if node.decorator_list:
        raise TypeError(f"{name} is decorated ({fn.__code__.co_filename}, line {node.lineno}); a decorated "
                        "function cannot travel as source: send the undecorated function")
    return source


def _without_defaults(source: str) -> str:
    """``source`` with each parameter default replaced by ``None`` (same lines: tracebacks keep their numbers).

    Defaults are values computed where the function was defined (``i=i`` binds a loop variable); they
    travel as captured values and are set on the rebuilt function (:mod:`.rebuild`), so that the
    source the other side checks holds no expression of the defining scope.
    """
    node = ast.parse(source).body[0]
    spans = [d for d in (*node.args.defaults, *node.args.kw_defaults) if d is not None]
    lines = [line.encode() for line in source.splitlines(True)]
    for d in sorted(spans, key=lambda d: (d.lineno, d.col_offset), reverse=True):
        first, last = d.lineno - 1, d.end_lineno - 1
        head, tail = lines[first][:d.col_offset], lines[last][d.end_col_offset:]
        lines[first:last + 1] = [head + b"None" + b"\n" * (last - first) + tail]
    return b"".join(lines).decode()


def _reads(fn):
    """``(name, value)`` for each closure variable and global ``fn`` reads (builtins and unbound names left out)."""
    code = fn.__code__
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            yield name, cell.cell_contents
        except ValueError:   # not bound yet: it fails the same way on the other side
            continue
    glob = fn.__globals__
    for name in sorted(_global_names(code)):
        if name in glob:
            yield name, glob[name]


@functools.lru_cache(maxsize=256)   # per code object: a sweep sends the same function thousands of times
def _global_names(code) -> frozenset:
    found = {ins.argval for ins in dis.get_instructions(code) if ins.opname in _LOADS}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found |= _global_names(const)
    return frozenset(found)


@functools.lru_cache(maxsize=256)
def _cell_write(code):
    """The enclosing function's variable that ``code`` assigns (``nonlocal``), or ``None``."""
    for ins in dis.get_instructions(code):
        if ins.opname in _CELL_STORES and ins.argval in code.co_freevars:
            return ins.argval
    return None


def _refuse_cell_writes(fn):
    code = fn.__code__
    name = _cell_write(code)
    if name is not None:
        raise TypeError(f"{fn.__qualname__} assigns the enclosing function's variable {name!r} "
                        f"(`nonlocal`, line {_line(code, name)}); a captured function gets copies "
                        "of what it reads: return the value instead, or put it in an ai.Future")


def _line(code, name):
    """The first line where ``code`` (or code nested in it) reads or writes ``name``."""
    line = code.co_firstlineno
    for ins in dis.get_instructions(code):
        line = getattr(ins, "line_number", None) or (ins.starts_line if type(ins.starts_line) is int else line)
        if ins.argval == name and ins.opname.startswith(("LOAD", "STORE", "DELETE")):
            return line
    for const in code.co_consts:
        if isinstance(const, types.CodeType) and (name in const.co_names or name in const.co_freevars):
            return _line(const, name)
    return code.co_firstlineno


def _cannot(fn, name, value, why) -> TypeError:
    where = f"{fn.__code__.co_filename}, line {_line(fn.__code__, name)}"
    return TypeError(f"{fn.__qualname__} reads {name!r} ({where}), a {type(value).__module__}."
                     f"{type(value).__qualname__}, which cannot travel: {why}. Pass what you need as a tensor, "
                     "number, string or a list/dict of these, or compute it inside the function")


def partial_parts(fn):
    """``(function, keywords)`` of an intervention (a ``functools.partial`` with keywords only, or a function)."""
    if isinstance(fn, functools.partial):
        if fn.args:
            raise TypeError(f"{fn!r}: a partial intervention may bind keywords only to travel")
        inner, keywords = partial_parts(fn.func)
        return inner, {**keywords, **fn.keywords}
    return fn, {}
