"""The sandbox's policy module is the whole rule: attribute names are checked against its allow-list."""

import ast
import builtins
import keyword

import pytest
import torch

from asyncinterp.hooks.envoy import SEMANTIC_NAMES
from asyncinterp.models import tiny
from asyncinterp.serve.sandbox import Program, SandboxRefused, check_source, instrument, modules, policy, \
    safe_builtins


@pytest.fixture(scope="module")
def model():
    return tiny("gpt2")


def run_submitted(model, source, params=None, entry=None):
    fn, _ = Program(source, entry).bind(params or {})
    return model.trace("Hello there world", fn)


def _verdict(name: str) -> str:
    """How the sandbox treats `x.name` on a value that is not the model: refused, plain, or model_only."""
    try:
        tree = check_source(f"async def f(m, x):\n    return x.{name}\n")
    except SandboxRefused:
        return "refused"
    calls = [n for n in ast.walk(instrument(tree)) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    return "model_only" if any(c.func.id == "__ai_member__" for c in calls) else "plain"


def _probe_names():
    names = set(policy.ALLOWED_ATTRIBUTES) | set(policy.REFUSED_ATTRIBUTES) | set(SEMANTIC_NAMES)
    for obj in (torch.Tensor, torch, torch.nn.functional, str, bytes, list, dict, set, int, float, BaseException,
                torch.finfo, torch.dtype, torch.device, type(iter([])), type(x for x in ()), Program):
        names |= set(dir(obj))
    names |= {"task", "kernel", "host", "coro", "group", "parent", "last_value", "module", "weight", "training",
              "model", "transformer", "layers", "eps_", "to_real", "anything"}
    return sorted(n for n in names if n.isidentifier() and not keyword.iskeyword(n))


def test_only_names_on_the_allow_list_are_read_plainly():
    """The checker's verdict on every probed attribute name follows policy.ALLOWED_ATTRIBUTES alone: a name on
    it is read as is, any other is refused at submission or read only through the model check (a deny-list
    would let unlisted names through as is)."""
    verdicts = {name: _verdict(name) for name in _probe_names()}
    plain = {n for n, v in verdicts.items() if v == "plain"}
    assert plain == {n for n in verdicts if n in policy.ALLOWED_ATTRIBUTES}
    for name, verdict in verdicts.items():
        if name.startswith("_") or name in policy.REFUSED_ATTRIBUTES:
            assert verdict == "refused", name
    assert verdicts["task"] == verdicts["kernel"] == verdicts["anything"] == "model_only"
    assert verdicts["storage"] == verdicts["data"] == "refused"   # torch ops left out
    # gradient names are read as they are: m.x.output.grad, m.backward, torch.autograd; a PrivateTensor still
    # refuses its own .grad and .backward() when they run (tests/test_serve_gradients.py)
    assert verdicts["grad"] == verdicts["backward"] == verdicts["autograd"] == "plain"


def test_the_checker_reads_the_allow_list_from_the_policy(monkeypatch):
    assert _verdict("softmax") == "plain"
    monkeypatch.setattr(policy, "ALLOWED_ATTRIBUTES", policy.ALLOWED_ATTRIBUTES - {"softmax"})
    assert _verdict("softmax") == "model_only"


def test_unlisted_attribute_is_refused_where_it_is_read(model):
    # the handle of a sub-task led, through attributes no list names, to the kernel and the run (every request)
    src = ("from asyncinterp import spawn\nasync def helper():\n    return 1\nasync def f(m):\n"
           "    t = await spawn(helper())\n    return t.task.kernel.host\n")
    with pytest.raises(SandboxRefused, match=r"attribute 'task' of a TaskHandle .*\(line 6\).*allow-list"):
        run_submitted(model, src, entry="f")
    # harmless-looking, but not listed: a params map is read by key, a dtype has no listed `to_real`
    with pytest.raises(SandboxRefused, match=r"attribute 'alpha' of a Record .*line 2.*value\['alpha'\]"):
        run_submitted(model, "async def f(m, cfg):\n    return cfg.alpha\n", {"cfg": {"alpha": 2}})
    assert run_submitted(model, "async def f(m, cfg):\n    return cfg['alpha']\n", {"cfg": {"alpha": 2}}) == 2
    with pytest.raises(SandboxRefused, match=r"attribute 'to_real' of a dtype"):
        run_submitted(model, "import torch\nasync def f(m):\n    return torch.float32.to_real()\n")
    with pytest.raises(SandboxRefused, match=r"torch.nn.functional.grid_sample is not available .*line 3"):
        run_submitted(model, "import torch.nn.functional as F\nasync def f(m):\n    return F.grid_sample\n")


def test_the_model_answers_names_outside_the_list(model):
    src = ("async def f(m):\n    h = await m.transformer.h[0].output\n    l = m.layers[1]\n"
           "    return h.shape[-1], l.path, (await l.attn.output)[0].shape[-1]\n")
    assert run_submitted(model, src) == (64, "transformer.h.1", 64)
    with pytest.raises(AttributeError, match="no submodule or hook point 'weight'"):
        run_submitted(model, "async def f(m):\n    return m.lm_head.weight\n")


def test_imported_names_must_be_on_the_list():
    with pytest.raises(SandboxRefused, match=r"'Kernel' cannot be imported from asyncinterp .*line 1.*allow-list"):
        check_source("from asyncinterp import Kernel\nasync def f(m):\n    return 1\n")
    check_source("from torch.nn import functional as F\nfrom math import sqrt\nasync def f(m):\n    return 1\n")


def test_the_policy_lists_agree_with_what_runs():
    assert not policy.ALLOWED_ATTRIBUTES & policy.REFUSED_ATTRIBUTES
    assert SEMANTIC_NAMES <= policy.ASSIGNABLE_POINTS
    assert not set(policy.REFUSED_BUILTINS) & policy.BUILTINS
    assert set(safe_builtins()) == {n for n in policy.BUILTINS if hasattr(builtins, n)} | set(
        policy.REPLACED_BUILTINS)
    assert set(modules()) == set(policy.ALLOWED_MODULES)
    for name, proxy in modules().items():
        held = set(dir(proxy))
        assert held <= policy.ALLOWED_ATTRIBUTES, (name, held - policy.ALLOWED_ATTRIBUTES)


def test_hook_points_offer_what_the_policy_lists():
    from asyncinterp.serve.sandbox import SafePoint
    offered = {n for n in vars(SafePoint) if not n.startswith("_")}
    assert offered == policy.POINT_ATTRIBUTES
