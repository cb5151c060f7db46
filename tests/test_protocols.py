"""``Run`` implements the interfaces declared as Protocols: the kernel's ``KernelHost`` and the hooks' ``RunHost``.

Every method, property and attribute a Protocol declares must exist on
``asyncinterp.run.Run`` with a signature a caller of the Protocol can use
(the same positional parameters in the same order, the keyword ones by name,
defaults where the Protocol has them, no extra required ones). Removing or
renaming a method, or a parameter, fails here.
"""

import inspect

import pytest

import asyncinterp as ai

from asyncinterp.hooks.host import RunHost
from asyncinterp.kernel.host import KernelHost
from asyncinterp.run import Run

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def declared(protocol) -> dict:
    """Name -> ``"method"``, ``"property"`` or ``"attribute"`` for each member ``protocol`` declares itself."""
    members = {name: "attribute" for name in protocol.__dict__.get("__annotations__", {})}
    for name, value in vars(protocol).items():
        if name.startswith("_"):
            continue
        if isinstance(value, property):
            members[name] = "property"
        elif inspect.isfunction(value):
            members[name] = "method"
    return members


def signature_problems(expected, actual) -> list:
    """Why a call written against ``expected`` (a function) may fail on ``actual``; empty when none."""
    want, have = inspect.signature(expected).parameters, inspect.signature(actual).parameters
    kinds = {p.kind for p in have.values()}
    have_positional = [p for p in have.values() if p.kind in _POSITIONAL]
    want_positional = [p for p in want.values() if p.kind in _POSITIONAL]
    problems = []
    for i, p in enumerate(want_positional):
        if i >= len(have_positional):
            if inspect.Parameter.VAR_POSITIONAL not in kinds:
                problems.append(f"parameter {p.name!r} is missing")
            continue
        q = have_positional[i]
        if q.name != p.name and p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            problems.append(f"parameter #{i} is {q.name!r}, not {p.name!r}")
        if p.default is not inspect.Parameter.empty and q.default is inspect.Parameter.empty:
            problems.append(f"parameter {p.name!r} has no default")
    for q in have_positional[len(want_positional):]:
        if q.default is inspect.Parameter.empty:
            problems.append(f"extra required parameter {q.name!r}")
    for p in want.values():
        if p.kind is inspect.Parameter.KEYWORD_ONLY:
            q = have.get(p.name)
            if q is None or q.kind in _VARIADIC or q.kind is inspect.Parameter.POSITIONAL_ONLY:
                if inspect.Parameter.VAR_KEYWORD not in kinds:
                    problems.append(f"keyword parameter {p.name!r} is missing")
            elif p.default is not inspect.Parameter.empty and q.default is inspect.Parameter.empty:
                problems.append(f"keyword parameter {p.name!r} has no default")
        elif p.kind in _VARIADIC and p.kind not in kinds:
            problems.append(f"{'*' if p.kind is inspect.Parameter.VAR_POSITIONAL else '**'}{p.name} is missing")
    for q in have.values():
        if q.kind is inspect.Parameter.KEYWORD_ONLY and q.default is inspect.Parameter.empty and q.name not in want:
            problems.append(f"extra required keyword parameter {q.name!r}")
    return problems


def conformance_problems(protocol, cls, instance) -> list:
    """What ``cls`` (and ``instance``, for attributes set in ``__init__``) lacks of ``protocol``."""
    problems = []
    for name, kind in declared(protocol).items():
        if kind == "attribute":
            if not hasattr(instance, name):
                problems.append(f"{cls.__name__}.{name}: attribute missing")
            continue
        impl = inspect.getattr_static(cls, name, None)
        if impl is None:
            problems.append(f"{cls.__name__}.{name}: {kind} missing")
        elif kind == "property":
            if not isinstance(impl, property) and not hasattr(instance, name):
                problems.append(f"{cls.__name__}.{name}: not a property")
        elif not inspect.isfunction(impl):
            problems.append(f"{cls.__name__}.{name}: not a method")
        else:
            problems += [f"{cls.__name__}.{name}: {p}" for p in signature_problems(vars(protocol)[name], impl)]
    return problems


@pytest.mark.parametrize("protocol", [KernelHost, RunHost], ids=lambda p: p.__name__)
def test_run_implements_the_protocol(protocol):
    members = declared(protocol)
    assert members, f"{protocol.__name__} declares nothing: the test would prove nothing"
    assert conformance_problems(protocol, Run, Run(None, ai.Job())) == []


def test_kernel_host_declares_what_the_kernel_calls():
    assert set(declared(KernelHost)) == {"activate", "already_ran", "view_of", "parked_holding", "left_step_loop"}


def test_a_removed_or_renamed_method_or_parameter_is_caught():
    class Proto:
        size: int

        def fire(self, point, value, interrupt: bool = True): ...

        def stop(self, invoke=None): ...

        @property
        def busy(self) -> bool: ...

    class Renamed:
        def __init__(self):
            self.size = 1

        def fire(self, point, val, interrupt=True): ...   # renamed parameter

        def halt(self, invoke=None): ...                  # stop renamed

        busy = False

    class Stricter:
        def fire(self, point, value, interrupt, extra): ...   # lost a default, gained a required parameter

        def stop(self, invoke=None, *, now): ...

        @property
        def busy(self):
            return False

    renamed = conformance_problems(Proto, Renamed, Renamed())
    assert "Renamed.fire: parameter #2 is 'val', not 'value'" in renamed
    assert "Renamed.stop: method missing" in renamed
    assert not any("busy" in p or "size" in p for p in renamed)
    stricter = conformance_problems(Proto, Stricter, Stricter())
    assert set(stricter) == {
        "Stricter.size: attribute missing",
        "Stricter.fire: parameter 'interrupt' has no default",
        "Stricter.fire: extra required parameter 'extra'",
        "Stricter.stop: extra required keyword parameter 'now'",
    }
