"""Build the API reference from the docstrings with pdoc, into build/api/ (git-ignored).

    python scripts/build_api_docs.py            # -> build/api/index.html
    python scripts/build_api_docs.py --out DIR

Any warning is an error: every warning (pdoc's own, e.g. a name in ``__all__``
that does not resolve, and any raised while importing the library) stops the
build, and so does a cross reference in a documented docstring
(``:class:`X```, ``:func:`X```, ...) that names nothing importable.

vLLM is never imported: ``asyncinterp.models.vllm`` imports it lazily, and this
script blocks ``import vllm`` so the reference is the same with or without it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import os
import pathlib
import re
import sys
import warnings

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The documented modules, and the names each one exposes lazily (through a
# module ``__getattr__``) that the reference should show besides its ``__all__``.
MODULES: dict[str, list[str]] = {
    "asyncinterp": ["LanguageModel", "Generation", "VLLM"],
    "asyncinterp.models": ["LanguageModel", "Generation", "Generated", "smollm2", "tiny", "VLLM"],
    "asyncinterp.models.vllm": [],
    "asyncinterp.serve": [],
    "asyncinterp.kernel": [],
    "asyncinterp.hooks.host": [],
}

ROLE = re.compile(r":(?:class|func|meth|mod|exc|attr|data|obj):`~?([^`<>]+)`")


def load_modules():
    """Import the documented modules and make their lazy names real attributes (pdoc reads ``__dict__``)."""
    sys.modules.setdefault("vllm", None)  # `import vllm` raises ImportError: the docs never need the engine
    mods = []
    for name, lazy in MODULES.items():
        mod = importlib.import_module(name)
        public = list(getattr(mod, "__all__", []))
        for attr in public + lazy:
            if attr not in mod.__dict__:
                setattr(mod, attr, getattr(mod, attr))
        if lazy:
            mod.__all__ = public + [a for a in lazy if a not in public]
        mods.append(mod)
    return mods


def _resolve(dotted: str):
    """The object a dotted name denotes (importing its module), or raise LookupError."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for p in parts[i:]:
                obj = getattr(obj, p)
        except AttributeError:
            continue
        return obj
    raise LookupError(dotted)


def _resolves(target: str, modulename: str, qualname: str, is_class: bool) -> bool:
    """Resolve like Sphinx would: relative to the defining module and the enclosing classes, or absolute."""
    if target.startswith("."):
        pkg = modulename if _is_package(modulename) else modulename.rpartition(".")[0]
        candidates = [importlib.util.resolve_name(target, pkg)]
    else:
        scopes = qualname.split(".") if qualname else []
        if not is_class:
            scopes = scopes[:-1]
        candidates = [f"{modulename}.{'.'.join(scopes[:i] + [target])}" for i in range(len(scopes), -1, -1)]
        candidates.append(target)
    for c in candidates:
        try:
            _resolve(c)
            return True
        except (LookupError, ImportError):
            pass
    return False


def _is_package(modulename: str) -> bool:
    return hasattr(sys.modules.get(modulename), "__path__")


def broken_references(docs) -> list[str]:
    """Cross references in the documented docstrings that name nothing importable."""
    import pdoc.doc

    broken, seen = [], set()

    def walk(d):
        if id(d) in seen:
            return
        seen.add(id(d))
        for target in ROLE.findall(d.docstring or ""):
            modulename, qualname = d.taken_from
            if not _resolves(target.strip(), modulename, qualname, isinstance(d, pdoc.doc.Class)):
                broken.append(f"{d.fullname}: cross reference to {target!r} does not resolve")
        if isinstance(d, (pdoc.doc.Module, pdoc.doc.Class)):
            for m in d.own_members if isinstance(d, pdoc.doc.Class) else d.members.values():
                if m.modulename.startswith("asyncinterp"):
                    walk(m)

    for d in docs:
        walk(d)
    return broken


def build(out: pathlib.Path) -> None:
    warnings.simplefilter("error")  # every warning is an error, pdoc's included
    sys.path.insert(0, str(ROOT / "src"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import pdoc
    import pdoc.doc
    import pdoc.extract
    import pdoc.render

    mods = load_modules()
    pdoc.render.configure(docformat="restructuredtext", show_source=True, search=True)
    names = list(pdoc.extract.walk_specs([m.__name__ for m in mods]))  # with the submodules pdoc includes
    broken = broken_references([pdoc.doc.Module.from_name(n) for n in names])
    if broken:
        raise SystemExit("broken cross references in docstrings:\n  " + "\n  ".join(broken))
    pdoc.pdoc(*names, output_directory=out)
    missing = [m.__name__ for m in mods if not (out / (m.__name__.replace(".", "/") + ".html")).exists()]
    if missing:
        raise SystemExit(f"no page written for {missing}")
    print(f"API reference: {out / 'index.html'} ({len(mods)} modules)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "build" / "api")
    args = parser.parse_args(argv)
    build(args.out.resolve())


if __name__ == "__main__":
    main()
