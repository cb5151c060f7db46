"""Named edits and adapters chosen by model name: ``MODEL``, ``MODEL:honest``, ``MODEL:honest+calm``.

Why this module exists: an unmodified OpenAI client (an evaluation harness,
a chat UI) can only choose a ``model``. The server owner installs named
edits (``asyncinterp serve MODEL --edit honest=edits.py:honesty``), and the
``model`` field of a request selects them, with no extension field:

* ``MODEL`` — the plain model;
* ``MODEL:honest`` — the model under the edit ``honest``;
* ``MODEL:honest+calm`` — under several edits, run in the order written
  (any ``+``-joined list of distinct installed edits; ``/v1/models`` lists
  the plain model and each single edit);
* ``ADAPTER`` / ``ADAPTER:honest`` — a LoRA adapter installed with
  ``--lora-modules ADAPTER=PATH`` (as vLLM's server names them), alone or
  under edits.

An edit is either an ``async def fn(m)`` called once per forward pass (each
generation step), as ``model.edit(fn)`` runs it, or a registered intervention
with fixed parameters (a whole-run intervention such as the built-in
``steer``). The edits run in the request's own invoke, before the request's
own intervention (``asyncinterp`` extension field), so that intervention
sees the edited model, and only the request's own rows are edited.

On vLLM, requests under the same edit set share the prefix cache with each
other and never with other sets or with plain requests: their cache scope
(:attr:`Selection.scope`) is derived from the edits' content hashes. That is
sound because an edit is the server owner's trusted code that changes each
position the same way whatever else is in the batch (a steering vector, an
ablation); the server cannot check it. A request that adds its own
intervention gets a private cache, as every intervened request does.

The option syntax (``--edit NAME=SPEC``):

* ``NAME=FILE.py:FUNCTION`` — an ``async def FUNCTION(m)`` of a Python file, per pass;
* ``NAME=INTERVENTION`` or ``NAME=INTERVENTION:k=v,k=v`` — a registered intervention
  (built-in or from ``--interventions``) with fixed parameters; each value is
  read as JSON when it parses (``4``, ``true``, ``[0.1, 0.2]``), else as a string;
* ``NAME=INTERVENTION:{"k": v}`` — the parameters as one JSON object;
* ``NAME=INTERVENTION:@FILE`` — that JSON object read from a file (a steering
  vector saved by a harvest, docs/harvest.md).

Edit and adapter names are 1-64 letters, digits, ``_``, ``-`` or ``.``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass

import torch

from .receipts import content_hash, function_hash

__all__ = ["Adapter", "Edit", "ModelNames", "Selection", "install_edit", "load_edit_function",
           "parse_edit_option", "parse_lora_option"]

_NAME = NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
MAX_EDITS_PER_NAME = 8


@dataclass(frozen=True)
class Edit:
    """An installed edit: ``fn`` is a whole-run intervention (``async def fn(m)``), ``digest`` its content hash."""

    name: str
    fn: object
    digest: str
    origin: str


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter served under ``name`` (``--lora-modules name=path``); ``digest`` hashes its files."""

    name: str
    path: str
    digest: str


@dataclass(frozen=True)
class Selection:
    """What a ``model`` name selects: the edits (in order) and the adapter, if any."""

    name: str
    edits: tuple = ()
    adapter: Adapter | None = None

    @property
    def fns(self) -> tuple:
        return tuple(e.fn for e in self.edits)

    @property
    def scope(self) -> str | None:
        """The prefix-cache scope of requests under exactly these edits (``None``: no edits)."""
        if not self.edits:
            return None
        return "edits-" + content_hash([e.digest for e in self.edits]).split(":", 1)[1][:40]


class ModelNames:
    """The served model names of one server: the base name, its edits and adapters."""

    def __init__(self, base: str):
        self.base = base
        self.edits: dict[str, Edit] = {}
        self.adapters: dict[str, Adapter] = {}

    def check_name(self, kind, name):
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"{kind} name {name!r}: use 1-64 letters, digits, '_', '-' or '.'")
        if name in self.edits or name in self.adapters or name == self.base:
            raise ValueError(f"the name {name!r} is already taken (edits: {sorted(self.edits)}, adapters: "
                             f"{sorted(self.adapters)}, model: {self.base!r})")

    def add_edit(self, edit: Edit) -> None:
        self.check_name("edit", edit.name)
        self.edits[edit.name] = edit

    def add_adapter(self, name: str, path: str) -> Adapter:
        self.check_name("adapter", name)
        adapter = Adapter(name, path, _files_hash(path))
        self.adapters[name] = adapter
        return adapter

    def listed(self) -> list:
        """The names ``GET /v1/models`` lists: the model, each edit on it, each adapter, as ``(id, parent)``."""
        out = [(self.base, None)] + [(f"{self.base}:{e}", self.base) for e in self.edits]
        out += [(a, self.base) for a in self.adapters]
        return out

    def resolve(self, name: str) -> Selection:
        """The :class:`Selection` of a request's ``model``; ``LookupError`` (saying what exists) otherwise."""
        if name == self.base:
            return Selection(name)
        if name in self.adapters:
            return Selection(name, (), self.adapters[name])
        head, sep, tail = name.rpartition(":")
        if sep and (head == self.base or head in self.adapters) and tail:
            parts = tail.split("+")
            unknown = [p for p in parts if p not in self.edits]
            if not unknown and len(set(parts)) == len(parts) and len(parts) <= MAX_EDITS_PER_NAME:
                return Selection(name, tuple(self.edits[p] for p in parts), self.adapters.get(head))
            if unknown:
                raise LookupError(f"the model {name!r} does not exist here: no edit named "
                                  f"{', '.join(repr(u) for u in unknown)}; {self._available()}")
            raise LookupError(f"the model {name!r} does not exist here: name each edit once, at most "
                              f"{MAX_EDITS_PER_NAME}; {self._available()}")
        raise LookupError(f"the model {name!r} does not exist here; {self._available()}")

    def _available(self) -> str:
        names = [n for n, _ in self.listed()]
        extra = f" (and edits joined with '+', e.g. '{self.base}:a+b')" if len(self.edits) > 1 else ""
        return f"available: {names}{extra} (GET /v1/models)"


def _files_hash(path: str) -> str:
    """A hash of every file under ``path`` (names and bytes, in name order)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"adapter path {path!r} does not exist")
    parts = []
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)
    for f in files:
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        parts.append([os.path.relpath(f, path) if f != path else "", h.hexdigest()])
    return content_hash(parts)


# ----------------------------------------------------------------------------- making edits
def per_pass(fn):
    """A whole-run intervention that calls the per-pass edit ``fn(m)`` once per forward pass (as ``model.edit``)."""
    async def edit_task(m):
        async for _ in m.steps():
            await fn(m)
    edit_task.__qualname__ = f"edit {getattr(fn, '__qualname__', repr(fn))}"
    return edit_task


def load_edit_function(path: str, name: str):
    """The ``async def`` named ``name`` in the Python file ``path``."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"edit file {path!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"asyncinterp_edits_{abs(hash(os.path.abspath(path)))}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load edits from {path!r} (a .py file)")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if fn is None:
        raise ValueError(f"{path} defines no {name!r}; its functions: "
                         f"{sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith('_'))}")
    return fn


def install_edit(server, name: str, fn=None, *, intervention: str | None = None, params: dict | None = None,
                 origin: str | None = None) -> Edit:
    """Install the edit ``name`` on ``server``: ``fn`` (an ``async def fn(m)``, per pass, as ``model.edit``),
    or the registered ``intervention`` bound to ``params`` (a whole-run intervention with fixed parameters)."""
    from ...tools.edit import _check as check_edit
    from ..scheduling.params import BadRequest
    server.names.check_name("edit", name)
    if (fn is None) == (intervention is None):
        raise ValueError("give an edit either a function or a registered intervention's name")
    if fn is not None:
        if params:
            raise ValueError("params go with a registered intervention; bind a function's values yourself")
        check_edit(fn)
        edit = Edit(name, per_pass(fn), content_hash("function", function_hash(fn)),
                    origin or getattr(fn, "__qualname__", repr(fn)))
    else:
        reg = server.interventions.get(intervention)
        if reg is None:
            raise ValueError(f"edit {name!r}: no registered intervention named {intervention!r}; registered: "
                             f"{sorted(server.interventions)}")
        params = {k: _tensor_param(reg, k, v) for k, v in (params or {}).items()}
        try:
            bound = reg.bind(params, server.model)
        except BadRequest as exc:
            raise ValueError(f"edit {name!r}: {exc}") from None
        edit = Edit(name, bound, content_hash("registered", function_hash(reg.fn), params),
                    origin or f"{intervention}:{json.dumps(_plain(params), sort_keys=True)}")
    server.names.add_edit(edit)
    return edit


def _tensor_param(reg, name, value):
    p = reg.params.get(name)
    if p is not None and p.type is torch.Tensor and isinstance(value, list):
        return torch.tensor(value, dtype=torch.float32)
    return value


def _plain(params):
    return {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in params.items()}


# ----------------------------------------------------------------------------- the command line
def parse_edit_option(text: str) -> tuple:
    """``--edit NAME=SPEC`` -> ``(name, ("file", path, function) | ("intervention", name, params))``."""
    name, sep, spec = text.partition("=")
    if not sep or not name or not spec:
        raise ValueError(f"--edit takes NAME=FILE.py:FUNCTION or NAME=INTERVENTION[:k=v,...], got {text!r}")
    target, colon, rest = spec.partition(":")
    if target.endswith(".py"):
        if not colon or not rest.isidentifier():
            raise ValueError(f"--edit {name}={spec}: name the function, as in {name}={target}:my_edit")
        return name, ("file", target, rest)
    if not target.isidentifier():
        raise ValueError(f"--edit {name}={spec}: {target!r} is neither a .py file nor an intervention's name")
    return name, ("intervention", target, parse_params(rest) if colon else {})


def parse_params(text: str) -> dict:
    """``k=v,k=v`` (values as JSON when they parse, commas inside brackets kept), one JSON object, or
    ``@FILE``: a file holding one JSON object."""
    text = text.strip()
    if text.startswith("@"):
        path = text[1:]
        if not os.path.isfile(path):
            raise ValueError(f"edit parameters {text!r}: no file {path!r} (write @PATH to a JSON object)")
        with open(path) as fh:
            text = fh.read().strip()
        if not text.startswith("{"):
            raise ValueError(f"edit parameters in {path!r} must be one JSON object")
    if text.startswith("{"):
        try:
            out = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"edit parameters {text!r} are not a JSON object ({exc})") from None
        if not isinstance(out, dict):
            raise ValueError(f"edit parameters {text!r} must be a JSON object")
        return out
    out = {}
    for item in _split_top(text):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ValueError(f"edit parameter {item!r}: write NAME=VALUE")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def _split_top(text: str) -> list:
    items, depth, cur = [], 0, []
    for c in text:
        if c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        if c == "," and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    if cur:
        items.append("".join(cur))
    return [i for i in items if i.strip()]


def parse_lora_option(text: str) -> tuple:
    """``--lora-modules NAME=PATH`` (or vLLM's JSON form ``{"name": NAME, "path": PATH}``) -> ``(name, path)``."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--lora-modules: {text!r} is not valid JSON ({exc})") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str):
            raise ValueError(f'--lora-modules takes NAME=PATH or {{"name": NAME, "path": PATH}}, got {text!r}')
        return spec["name"], spec["path"]
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules takes NAME=PATH, got {text!r}")
    return name, path


def install_from_options(server, edits=(), loras=()) -> None:
    """Install the command line's ``--edit`` and ``--lora-modules`` options on ``server``."""
    for text in loras:
        server.names.add_adapter(*parse_lora_option(text))
    for text in edits:
        name, (kind, target, extra) = parse_edit_option(text)
        if kind == "file":
            install_edit(server, name, load_edit_function(target, extra), origin=f"{target}:{extra}")
        else:
            install_edit(server, name, intervention=target, params=extra, origin=text.partition("=")[2])


def models_list(names: ModelNames, created: int) -> dict:
    """The ``GET /v1/models`` answer: the model, each edit on it and each adapter (``parent``: the model; the
    ``asyncinterp`` field: an edit's or adapter's content hash)."""
    data = []
    for name, parent in names.listed():
        entry = {"id": name, "object": "model", "created": created, "owned_by": "asyncinterp", "root": names.base,
                 "parent": parent}
        selection = names.resolve(name)
        if selection.edits:
            entry["asyncinterp"] = {"edits": [{"name": e.name, "hash": e.digest, "origin": e.origin}
                                              for e in selection.edits]}
        if selection.adapter is not None:      # as the receipt names it: the adapter's files' hash
            entry["asyncinterp"] = {"adapter": {"name": selection.adapter.name, "hash": selection.adapter.digest}}
        data.append(entry)
    return {"object": "list", "data": data}
