"""Envoys: proxies over ``nn.Module``s and the hook points they expose.

``ai.wrap(model)`` returns a tree of envoys mirroring ``named_modules()``:
``m.transformer.h[3].mlp``. An envoy never changes its module; it only names
it. Awaiting one of its hook points (``.output``, ``.input``, ``.inputs``)
asks the current run to install a hook on that module, lazily, so modules
nobody awaits cost nothing.

New hook points are declared with the :class:`point` descriptor on an envoy
subclass: a base point (``output`` or ``inputs``) plus ``read``/``write``
functions that map the base value to the value users see and back (e.g. a
per-head view of an attention output).
"""

from __future__ import annotations

import copy
import difflib

from ..kernel.errors import ModulePathError, NotInRunError
from ..kernel.scheduler import current_run, current_task
from .callers import call_quietly
from .modules import submodules
from .points import Point

_BASE_KINDS = ("output", "inputs")

#: TransformerLens's names, looked up on a miss only (see asyncinterp.hooks.semantic)
SEMANTIC_NAMES = frozenset(("resid_pre", "resid_mid", "resid_post", "q", "k", "v", "z", "pattern", "pre", "post",
                            "logits", "router", "per_expert", "routed"))   # (the last three: MoE blocks, hooks/moe.py)
_semantic = {"build": None, "tl": None}


_special_envoys: list = []   # (test(module) -> bool, envoy class): e.g. MoE routers (asyncinterp.hooks.moe)


def register_envoy_class(test, cls) -> None:
    """Make modules for which ``test(module)`` is true get envoys of class ``cls`` (unless the user chose one)."""
    _special_envoys.append((test, cls))


def special_envoy_class(module) -> type:
    """The envoy class registered for ``module`` (:func:`register_envoy_class`), else :class:`Envoy`."""
    for test, cls in _special_envoys:
        if test(module):
            return cls
    return Envoy


def register_semantic(builder) -> None:
    """Make ``Envoy.build_semantic_point`` use ``builder(envoy, name)`` (called once by asyncinterp.hooks.semantic)."""
    _semantic["build"] = builder


def register_tl_names(builder) -> None:
    """Make TransformerLens's ``hook_*`` names use ``builder(envoy, name)`` (called once by asyncinterp.hooks.tl_names)."""
    _semantic["tl"] = builder


class HookPoint(Point):
    """An awaitable hook point of one module (``m.x.output``)."""

    __slots__ = ("envoy", "name", "base_kind", "position")

    def __init__(self, envoy, name, base=None, read=None, write=None):
        self.envoy = envoy
        self.name = name
        self.base_kind = name if base is None else base.base_kind
        self.key = self if base is None else base.key
        self.read = read
        self.write = write
        self.gradient = None
        self.position = (envoy.module, self.base_kind)
        self.order_cache = None

    def describe(self) -> str:
        path = self.envoy.path
        return f"{path}.{self.name}" if path else self.name

    def __repr__(self):
        return f"<hook point {self.describe()}>"

    @property
    def hint(self) -> str:
        """Appended to the error of a point that never ran: its module was replaced or removed after the envoy was made."""
        envoy = self.envoy
        parent = envoy.parent
        if parent is None or (envoy.attached and not parent.attached):   # the root, or a module attached to it
            return ""
        if submodules(parent.module).get(envoy.path.rsplit(".", 1)[-1]) is envoy.module:
            return ""
        return (f"; {envoy.path} is no longer a submodule of the wrapped model (it was replaced or removed after "
                "its envoy was made): envoys mirror the module tree as first read, so wrap the model again")

    def activate_in(self, run, task) -> None:
        if self.envoy.root is not run.model:
            raise NotInRunError(
                f"{self.describe()} belongs to another wrapped model; inside this run await the hook points of "
                "the envoy your intervention received")
        run.install_point(self.key)


class point:
    """Descriptor declaring a hook point on an :class:`Envoy` subclass.

    ``point()`` on attribute ``output``/``inputs`` declares a base point.
    ``point(base="output", read=f, write=g)`` declares a derived point whose
    awaited value is ``f(base_value)`` and whose replacement ``v`` becomes
    ``g(v, base_value)`` at the base point.

    The first read makes the envoy's :class:`HookPoint` and stores it on the
    envoy under the same name (this is a non-data descriptor), so later reads
    are plain attribute reads. Assignments go through ``Envoy.__setattr__``,
    which calls :meth:`assign`.
    """

    def __init__(self, base: str | None = None, read=None, write=None, doc: str | None = None):
        self.base = base
        self.read = read
        self.write = write
        self.name = None
        self.__doc__ = doc

    def __set_name__(self, owner, name):
        self.name = name
        if self.base is None and name not in _BASE_KINDS:
            raise TypeError(f"hook point {name!r} needs base='output' or base='inputs' (and read/write functions)")

    def __get__(self, envoy, owner=None):
        if envoy is None:
            return self
        points = envoy.points
        hp = points.get(self.name)
        if hp is None:
            if self.base is None:
                hp = HookPoint(envoy, self.name)
            else:
                hp = HookPoint(envoy, self.name, getattr(envoy, self.base), self.read, self.write)
            points[self.name] = hp
        object.__setattr__(envoy, self.name, hp)   # found on the instance from now on
        return hp

    def assign(self, envoy, value):
        """``envoy.<name> = value``: replace the point's value (inside an intervention)."""
        self.__get__(envoy).replace(value)


def _first_arg(inputs):
    args, kwargs = inputs
    if args:
        return args[0]
    if kwargs:
        return next(iter(kwargs.values()))
    raise ValueError("the module was called without arguments; it has no .input")


def _with_first_arg(new, inputs):
    args, kwargs = inputs
    if args:
        return (new,) + tuple(args[1:]), kwargs
    key = next(iter(kwargs))
    return args, {**kwargs, key: new}


_INVOKE_COPIES = ("invoke copies",)   # not a string: never clashes with a point name


class Envoy:
    """Proxy of one module inside a wrapped model."""

    output = point(doc="the module's output (forward hook)")
    inputs = point(doc="(args, kwargs) the module is called with (forward pre-hook)")
    input = point(base="inputs", read=_first_arg, write=_with_first_arg,
                  doc="the module's first positional argument")

    #: True for a module attached to the model (``model.attach``) and its descendants: calls fire points
    attached = False
    #: for an attached module inside a run: the invoke whose calls this envoy's points see
    invoke = None
    #: modules attached to the model, by name (the root's own dict; ``None`` elsewhere)
    attachments = None

    #: names resolved once by ``__getattr__`` (child modules, standard names, semantic points) and kept on the
    #: instance, so that later reads are plain attribute reads (about 1 µs saved per ``.name`` for a child, 7 µs
    #: for a standard name); ``None`` until one is. See :meth:`forget_name`.
    _shortcuts = None

    #: the wrapped ``nn.Module`` (``module``), its dotted ``path`` (``''`` for the root) as in
    #: ``named_modules()``, the ``root`` envoy of the tree, the ``parent`` envoy (``None`` for the root),
    #: and the hook ``points`` made so far by name: plain attributes, read on the hot path.
    #: (A child module with one of these names is reached with ``envoy.child(name)``.)

    def __init__(self, module, path: str, root: "Envoy | None" = None, parent: "Envoy | None" = None):
        init = object.__setattr__
        init(self, "module", module)
        init(self, "path", path)
        init(self, "root", root if root is not None else self)
        init(self, "parent", parent)
        init(self, "_children", {})
        init(self, "points", {})

    # --------------------------------------------------------------- tree
    def reattached(self, root: "Envoy", parent: "Envoy | None") -> "Envoy":
        """A copy of this envoy (same module and path) hung under another root, with no children or points yet."""
        e = copy.copy(self)
        cached = vars(e)   # points and names cached on the instance belong to the original
        for name in [k for k, v in cached.items() if isinstance(v, Point) and isinstance(getattr(type(e), k, None), point)]:
            del cached[name]
        for name in self._shortcuts or ():
            cached.pop(name, None)
        cached.pop("_shortcuts", None)
        init = object.__setattr__
        init(e, "root", e if root is None else root)
        init(e, "parent", parent)
        init(e, "_children", {})
        init(e, "points", {})
        return e

    def envoy_class_for(self, module) -> type:
        """The envoy class for a child module (the root decides; see ``ai.wrap(envoys=...)``)."""
        return Envoy

    def _child(self, name: str) -> "Envoy":
        child = self._children.get(name)
        if child is None:
            module = submodules(self.module)[name]
            path = f"{self.path}.{name}" if self.path else name
            root = self.root
            child = root.envoy_class_for(module)(module, path, root, self)
            if self.attached:
                object.__setattr__(child, "attached", True)
                object.__setattr__(child, "invoke", self.invoke)
            self._children[name] = child
        return child

    def child(self, name: str) -> "Envoy":
        """The child envoy ``name`` (use for children whose names clash with hook points)."""
        if name not in submodules(self.module):
            raise self._missing(name)
        return self._child(name)

    def _keep(self, name: str, value):
        """Keep ``value`` as this envoy's attribute ``name`` (``__getattr__`` is not called for it again)."""
        shortcuts = self._shortcuts
        if shortcuts is None:   # setdefault: two threads reading their first name keep one set
            shortcuts = vars(self).setdefault("_shortcuts", set())
        shortcuts.add(name)
        object.__setattr__(self, name, value)
        return value

    def forget_name(self, name: str) -> None:
        """Resolve ``name`` again on its next read (after ``set_alias`` changed what it means).

        Child envoys and standard names are resolved once and kept: the
        envoy tree mirrors the module tree as it was when first read. After
        replacing or removing a submodule of the wrapped module, wrap it again.
        """
        shortcuts = self._shortcuts
        if shortcuts and name in shortcuts:
            shortcuts.discard(name)
            vars(self).pop(name, None)

    def __getattr__(self, name: str):
        module = object.__getattribute__(self, "module")
        if name in submodules(module):
            return self._keep(name, self._child(name))
        attachments = self.attachments   # modules attached to the model (Model.attach; root only)
        if attachments and name in attachments:
            return attachments[name].for_invoke()
        if name.startswith("__"):
            raise AttributeError(name)
        made = self.points.get(name)     # a semantic point made before (resid_mid, attn.q, ...)
        if made is not None:
            return self._keep(name, made)
        try:
            return getattr(module, name)
        except AttributeError:
            pass
        found = self.standard_name(name)   # only looked up on a miss
        if found is not None:
            return self._keep(name, found)
        raise self._missing(name) from None

    def standard_name(self, name: str):
        """What the standard name ``name`` means below this envoy, or ``None``.

        An alias (``layers``, ``attn``, ``mlp``, ...) gives the envoy it stands
        for; a TransformerLens name (``resid_pre``, ``attn.q``, ``mlp.post``,
        ``logits``) gives the semantic point, made once and kept in ``points``.
        """
        from .aliases import resolve
        found = resolve(self, name)
        if found is not None:
            return found
        if name in SEMANTIC_NAMES:
            made = self.points.get(name)
            if made is None:
                made = self.root.build_semantic_point(self, name)
                if made is not None:
                    self.points[name] = made
            return made
        if name.startswith("hook_") and _semantic["tl"] is not None:   # TransformerLens's hook names (tl_names)
            made = self.points.get(name)
            if made is None:
                made = _semantic["tl"](self, name)
                if made is not None:
                    self.points[name] = made
            return made
        return None

    def at(self, path: str):
        """The envoy or hook point that the dotted string ``path`` names below this envoy.

        ``m.at("model.layers.3.output")``, ``m.at("layers.3.resid_mid")``,
        ``m.at("blocks.3.hook_resid_post")`` (TransformerLens's name, as
        SAELens configs store it). See :func:`asyncinterp.hooks.aliases.lookup`.
        """
        from .aliases import lookup
        return lookup(self, path)

    def build_semantic_point(self, envoy, name: str):
        """The semantic point ``name`` of ``envoy`` (called on the root envoy), or ``None``.

        Engines with other module trees (vLLM) override this on their root envoy.
        """
        build = _semantic["build"]
        return None if build is None else build(envoy, name)

    def _missing(self, name):
        from .archs import Refused, alias_override, arch_name
        said = alias_override(self, name)
        where = self.path or type(self.module).__name__
        if isinstance(said, Refused):
            return ModulePathError(f"{where} has no {name!r} in architecture {arch_name(self)!r}: {said}")
        if name in ("router", "per_expert", "routed"):
            return ModulePathError(
                f"{where} has no {name!r}: it is not a sparse mixture-of-experts block (router / per_expert / "
                f"routed exist on those only); its output is {where}.output")
        from .aliases import STANDARD
        if name in STANDARD:        # no "did you mean": a similar name may compute something else
            tried = ", ".join(STANDARD[name])
            return ModulePathError(
                f"{where} has no {name!r}: {name!r} is a standard name, and no module of this architecture "
                f"({arch_name(self)!r}) is one of its spellings ({tried}). Its submodules are: "
                + (", ".join(list(submodules(self.module))[:12]) or "(none)"))
        if name in SEMANTIC_NAMES:
            return ModulePathError(
                f"{where} has no semantic point {name!r}: resid_pre/resid_mid/resid_post live on a decoder layer "
                "(m.layers[i]), q/k/v/z/pattern on its attention (m.layers[i].attn), pre/post on its MLP "
                "(m.layers[i].mlp; router/per_expert/routed on MoE blocks), logits on the model")
        names = list(submodules(self.module))
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
        if not close:
            close = [f"the semantic point {c}" for c in difflib.get_close_matches(name, sorted(SEMANTIC_NAMES), n=1,
                                                                                  cutoff=0.8)]
        hint = f" Did you mean {', '.join(c if c.startswith('the ') else repr(c) for c in close)}?" if close else ""
        listing = ", ".join(names[:12]) + (" ..." if len(names) > 12 else "")
        return ModulePathError(
            f"{where!s} has no submodule or attribute {name!r}.{hint} Its submodules are: {listing or '(none)'}")

    def __setattr__(self, name, value):
        attr = getattr(type(self), name, None)
        if isinstance(attr, point):
            attr.assign(self, value)
            return
        if isinstance(attr, property) and attr.fset is not None:
            attr.fset(self, value)
            return
        made = self.points.get(name)
        if made is None and attr is None:
            if name in SEMANTIC_NAMES or name.startswith("hook_"):
                made = getattr(self, name, None)
        if isinstance(made, Point):        # a semantic point (m.layers[1].resid_mid = h)
            made.replace(value)
            return
        raise AttributeError(
            f"cannot set {name!r} on envoy {self.path or '<root>'}: only hook points "
            f"(e.g. .output, .input) can be assigned, inside an intervention")

    def __await__(self):
        path = self.path or "the model"
        raise TypeError(f"`await {path}`: {path} is a module ({type(self.module).__name__}), not a hook point; "
                        f"await {path}.output or {path}.input")

    def __getitem__(self, index):
        if type(index) is int and index >= 0:  # ModuleList/Sequential: children are named "0", "1", ...
            child = self._children.get(str(index))
            if child is not None:
                return child
        keys = list(submodules(self.module))
        if isinstance(index, str):
            return self.child(index)
        if isinstance(index, slice):
            return [self._child(k) for k in keys[index]]
        try:
            return self._child(keys[index])
        except IndexError:
            raise ModulePathError(f"{self.path or '<root>'} has {len(keys)} submodules; index {index} is out of range") from None

    def __len__(self):
        return len(submodules(self.module))

    def __iter__(self):
        names = submodules(self.module)
        out = list(map(self._children.get, names))
        if None in out:   # some child envoys not made yet (envoys define no __eq__: `in` compares identity)
            out = [c if c is not None else self._child(k) for k, c in zip(names, out)]
        return iter(out)

    def children(self):
        return list(self)

    def modules(self):
        """This envoy and every descendant, depth first (like ``named_modules``)."""
        out = [self]
        for c in self:
            out.extend(c.modules())
        return out

    @property
    def source(self):
        """The calls inside this module's forward as hook points; print it to list them (see asyncinterp.hooks.source)."""
        from .source import source_of
        return source_of(self)

    # ------------------------------------------------------------ control
    def skip(self, value) -> None:
        """Do not run this module on its next call; it outputs ``value`` instead.

        For an invoke that covers part of the batch, the module still runs for
        the other rows and this invoke's rows are replaced by ``value``.
        """
        run = current_run()
        if run is None:
            raise NotInRunError(f"{self.path}.skip(...) must be called inside an intervention, before the module runs")
        run.skip(self, current_task(), value)

    def __call__(self, *args, **kwargs):
        """Call the module ad hoc: no hook point fires for this call, inside a run or outside one (a module
        called outside any run never reaches the hooks of a run executing elsewhere, see :mod:`.callers`).

        A module attached to the model (``model.attach(name, module)``) is
        different: calling it inside a run is a real call, and its own points fire.
        """
        run = current_run()
        if run is None:
            return call_quietly(self.module, args, kwargs)
        if self.attached:
            return run.call_attached(self, args, kwargs)
        return run.call_adhoc(self.module, args, kwargs)

    def for_invoke(self) -> "Envoy":
        """An attached module as seen by the current intervention's invoke (its points see that invoke's calls)."""
        task = current_task()
        if task is None:
            return self
        copies = self.points.setdefault(_INVOKE_COPIES, {})
        e = copies.get(task.group)
        if e is None:
            e = copies[task.group] = self.reattached(self.root, self.parent)
            object.__setattr__(e, "attached", True)
            object.__setattr__(e, "invoke", task.group)
        return e

    # ------------------------------------------------------------ display
    def __repr__(self):
        return self.tree(depth=0, max_depth=3)

    def tree(self, depth: int = 0, max_depth: int = 3) -> str:
        """The module tree below this envoy as text (what ``repr`` shows), ``max_depth`` levels deep."""
        name = self.path.rsplit(".", 1)[-1] if self.path else "<root>"
        line = "  " * depth + f"{name}: {type(self.module).__name__}"
        if depth >= max_depth or not submodules(self.module):
            if submodules(self.module) and depth >= max_depth:
                line += f" ({len(submodules(self.module))} children)"
            return line
        kids = list(self)
        lines = [line]
        # collapse runs of identical containers like layers.0..11
        if len(kids) > 3 and all(type(k.module) is type(kids[0].module) for k in kids):
            lines.append(kids[0].tree(depth + 1, max_depth))
            lines.append("  " * (depth + 1) + f"... {len(kids) - 1} more {type(kids[0].module).__name__}")
        else:
            lines.extend(k.tree(depth + 1, max_depth) for k in kids)
        return "\n".join(lines)
