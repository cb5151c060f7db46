"""Client-submitted interventions: refused before any model work, or run restricted."""

import os
import time

import pytest
import torch

import asyncinterp as ai
from asyncinterp.models import tiny
from asyncinterp.serve.sandbox import Program, SandboxRefused, SandboxTimeout, check_source


@pytest.fixture(scope="module")
def model():
    return tiny("gpt2")


def run_submitted(model, source, params=None, deadline=None, prompt="Hello there world"):
    fn, clock = Program(source).bind(params or {}, deadline)
    return model.trace(prompt, fn), clock


HOSTILE = {
    "import os": "import os\nasync def f(m):\n    return os.listdir('/')",
    "import subprocess": "async def f(m):\n    import subprocess\n    return subprocess.run(['id'])",
    "import socket": "import socket\nasync def f(m):\n    return socket.socket()",
    "from os import path": "from os import path\nasync def f(m):\n    return 1",
    "import os.path": "import os.path\nasync def f(m):\n    return 1",
    "from-import module of torch": "from torch import hub\nasync def f(m):\n    return 1",
    "importlib": "import importlib\nasync def f(m):\n    return 1",
    "relative import": "from . import x\nasync def f(m):\n    return 1",
    "open a file": "async def f(m):\n    return open('/etc/passwd').read()",
    "open for writing": "async def f(m):\n    with open('/tmp/pwned', 'w') as fh:\n        fh.write('x')",
    "__import__": "async def f(m):\n    return __import__('os')",
    "eval": "async def f(m):\n    return eval('1+1')",
    "exec": "async def f(m):\n    exec('import os')",
    "getattr string access": "async def f(m):\n    return getattr(m, '_module')",
    "dunder class walk": "async def f(m):\n    return ().__class__.__bases__[0].__subclasses__()",
    "globals of a function": "async def f(m):\n    return f.__globals__",
    "private attribute": "async def f(m):\n    return m._module",
    "format string attribute walk": "async def f(m):\n    return '{0.__class__}'.format(m)",
    "frame walk": "async def f(m):\n    def g():\n        yield 1\n    return g().gi_frame.f_back",
    "torch.load": "import torch\nasync def f(m):\n    return torch.load('/tmp/x.pt')",
    "torch.save": "import torch\nasync def f(m):\n    torch.save(1, '/tmp/x.pt')",
    "torch.from_file": "import torch\nasync def f(m):\n    return torch.from_file('/etc/passwd')",
    "torch.os": "import torch\nasync def f(m):\n    return torch.os.system('id')",
    "tensor to numpy to file": "async def f(m):\n    h = await m.transformer.h[0].output\n    h.numpy().tofile('/tmp/x')",
    "as_strided into other rows": "async def f(m):\n    h = await m.transformer.h[0].output\n    return h.as_strided((100,), (1,))",
    "the nn.Module": "async def f(m):\n    return m.lm_head.module.weight",
    "class definition": "class A:\n    pass\nasync def f(m):\n    return 1",
    "top-level code": "x = [0] * 10**10\nasync def f(m):\n    return 1",
    "top-level call": "import torch\ntorch.zeros(3)\nasync def f(m):\n    return 1",
    "decorator at top level": "import torch\n@torch.no_grad()\nasync def f(m):\n    return 1",
    "non-literal default": "async def f(m, x=[0] * 10**9):\n    return x",
    "global statement": "async def f(m):\n    global y\n    y = 1",
    "match class pattern": "async def f(m):\n    match m:\n        case _:\n            return 1",
    "syntax error": "async def f(m)\n    return 1",
    "too long": "async def f(m):\n    return 1\n" + "#" * 30000,
    "deep nesting": "async def f(m):\n    return " + "(" * 200 + "1" + ")" * 200,
    "NUL": "async def f(m):\n    return '\x00'",
    "no async def": "def f(m):\n    return 1",
    "two entry points": "async def f(m):\n    return 1\nasync def g(m):\n    return 2",
    "type() introspection": "async def f(m):\n    return type(m)",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_source_refused_before_running(name):
    with pytest.raises(SandboxRefused) as info:
        Program(HOSTILE[name])
    assert str(info.value)  # a reason, naming the line where there is one


def test_refusal_messages_are_clear():
    with pytest.raises(SandboxRefused, match=r"import of 'os' is not allowed .*line 1.*allowed modules: torch"):
        check_source("import os\nasync def f(m): pass")
    with pytest.raises(SandboxRefused, match=r"'open' is not available .*line 2.*no file access"):
        check_source("async def f(m):\n    open('x')")
    with pytest.raises(SandboxRefused, match=r"attribute '__class__' is not allowed"):
        check_source("async def f(m):\n    return m.__class__")


def test_user_names_shadowing_builtins_are_fine(model):
    src = ("import torch.nn.functional as F\n"
           "async def f(m, input=2):\n"
           "    type = 'x'\n"
           "    h = await m.transformer.h[0].output\n"
           "    return F.softmax(input=h[:, -1], dim=-1).shape[-1] * input, type\n")
    out, _ = run_submitted(model, src, {"input": 3})
    assert out == (64 * 3, "x")


def test_allowed_code_matches_local_run(model):
    src = '''
import torch
import math
import torch.nn.functional as F
from asyncinterp import gather

async def probe(m, layer, scale=1.0):
    """Read two points at once, edit in place, call a module ad hoc."""
    a, b = await gather(m.transformer.h[layer].output, m.transformer.h[layer + 1].output)
    first = a[:, -1].clone()
    h = await m.transformer.ln_f.output
    h.mul_(scale)
    logits = await m.lm_head.output
    lens = m.lm_head(first)
    return {"first": first, "top": logits[:, -1].topk(3).indices, "lens": lens,
            "norm": math.sqrt(float((first * first).sum())), "probs": F.softmax(logits[:, -1], -1).sum()}
'''
    out, _ = run_submitted(model, src, {"layer": 0, "scale": 0.5})

    async def probe(m, layer, scale=1.0):
        a, b = await ai.gather(m.transformer.h[layer].output, m.transformer.h[layer + 1].output)
        first = a[:, -1].clone()
        h = await m.transformer.ln_f.output
        h.mul_(scale)
        logits = await m.lm_head.output
        return {"first": first, "top": logits[:, -1].topk(3).indices, "lens": m.lm_head(first)}

    ref = model.trace("Hello there world", lambda m: probe(m, 0, 0.5))
    for k in ("first", "top", "lens"):
        assert torch.equal(out[k], ref[k])


def test_replacement_skip_and_steps(model):
    src = '''
import torch
async def f(m):
    h = await m.transformer.h[0].output
    m.transformer.h[0].output = torch.zeros_like(h)
    m.transformer.h[1].skip(torch.zeros_like(h))
    out = await m.transformer.ln_f.input
    n = 0
    async for step in m.steps():
        n += 1
    return out.abs().sum(), n
'''
    (s, n), _ = run_submitted(model, src)
    assert float(s) == 0.0 and n == 1


@pytest.mark.parametrize("expr, match", [
    ("m.lm_head.weight", "no submodule or hook point 'weight'"),
    ("(await m.transformer.h[0].output).grad", "tensor operation 'grad' is not available"),
    ("(await m.transformer.h[0].output).sum().backward()", "tensor operation 'backward' is not available"),
    ("m.transformer.h[0].forward", "no submodule or hook point"),
    ("torch.set_num_threads(1)", "not available to submitted code"),
    ("torch.manual_seed(0)", "not available to submitted code"),
    ("torch.zeros(10**6, 10**6)", "exceeds the limit"),
    ("list(range(10**9))", "exceeds the limit"),
])
def test_runtime_restrictions_fail_only_the_intervention(model, expr, match):
    src = f"import torch\nasync def f(m):\n    return {expr}\n"
    with pytest.raises(Exception, match=match):
        run_submitted(model, src)


def test_runaway_loop_is_stopped_by_the_deadline(model):
    src = '''
async def f(m):
    h = await m.transformer.h[0].output
    n = 0
    while True:
        try:
            n += 1
        except BaseException:
            pass
'''
    t0 = time.monotonic()
    with pytest.raises(SandboxTimeout):
        run_submitted(model, src, deadline=time.monotonic() + 0.3)
    assert time.monotonic() - t0 < 5
    # lambdas and comprehensions tick too
    src2 = "async def f(m):\n    return sum([x for x in range(10**7) for y in range(10)])\n"
    with pytest.raises(SandboxTimeout):
        run_submitted(model, src2, deadline=time.monotonic() + 0.2)


def test_cancelled_clock_stops_code(model):
    fn, clock = Program("async def f(m):\n    while True:\n        pass\n").bind({})
    clock.cancelled = True
    with pytest.raises(SandboxTimeout, match="cancelled"):
        model.trace("Hello", fn)


def test_params_are_checked_before_running():
    prog = Program("async def f(m, a, b=2, *, c):\n    return a\n")
    with pytest.raises(SandboxRefused, match="needs parameter"):
        prog.bind({"a": 1})
    with pytest.raises(SandboxRefused, match="takes no parameter"):
        prog.bind({"a": 1, "c": 2, "zzz": 3})
    with pytest.raises(SandboxRefused, match="exactly one top-level"):
        Program("async def f(m):\n    return 1\nasync def g(m):\n    return 1\n")
    assert Program("async def f(m):\n    return 1\nasync def g(m):\n    return 2\n", entry="g").entry == "g"
    with pytest.raises(SandboxRefused, match="model as its first argument"):
        Program("async def f():\n    return 1\n")


def test_traceback_shows_submitted_lines(model):
    import traceback
    src = "async def f(m):\n    h = await m.transformer.h[0].output\n    raise ValueError('boom')\n"
    with pytest.raises(ValueError) as info:
        run_submitted(model, src)
    text = "".join(traceback.format_exception(info.value))
    assert "<submitted:f:" in text and "raise ValueError('boom')" in text


def test_no_file_was_written():
    assert not os.path.exists("/tmp/pwned")


@pytest.mark.parametrize("stmt", [
    "torch.Tensor.softmax = None",               # would change the model's code for every request
    "F.softmax.leak = h",                        # a channel between requests
    "m.transformer.foo = h",
    "del m.transformer.h",
    "m.transformer.h[0].output += 1",
    "h.output, b = 1, 2",
    "h.output = b.output = 1",
    "for m.x in []: pass",
])
def test_attribute_assignment_is_refused(stmt):
    src = (f"import torch\nimport torch.nn.functional as F\nasync def f(m):\n    h = 1\n    b = 1\n"
           f"    {stmt}\n")
    with pytest.raises(SandboxRefused, match="not allowed|hook points"):
        Program(src)


def test_hook_point_assignment_only_on_the_model(model):
    ok = ("import torch\nasync def f(m):\n    h = await m.transformer.h[0].output\n"
          "    m.transformer.h[0].output = torch.zeros_like(h)\n    return (await m.transformer.h[1].input).abs().sum()\n")
    out, _ = run_submitted(model, ok)
    assert float(out) == 0.0
    bad = ("import torch\nasync def f(m):\n    torch.Tensor.output = 1\n")
    with pytest.raises(AttributeError, match="only assign hook points"):
        run_submitted(model, bad)
    assert not hasattr(torch.Tensor, "output")


def test_awaited_values_hide_other_objects(model):
    # the root output carries the KV cache of the whole batch: submitted code sees None there
    src = ("async def f(m):\n    out = await m.output\n"
           "    return out.logits.shape, out['past_key_values'], sorted(out.keys())\n")
    fn, _ = Program(src).bind({})
    shape, cache, keys = model.generate(SAME_PROMPT, fn, max_new_tokens=2).result
    assert cache is None and "logits" in keys and shape[0] == 1


def test_replacements_must_be_tensors(model):
    src = ("async def f(m):\n    out = await m.transformer.h[0].output\n"
           "    m.transformer.h[0].output = (out, out)\n")
    with pytest.raises(TypeError, match="tensors only"):
        run_submitted(model, src)


SAME_PROMPT = "Hello there world"


def test_out_of_order_inside_submitted_code_names_its_line():
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    model = ai.wrap(net)
    source = "async def f(m):\n    await m[2].output\n    await m[0].output\n"
    fn, _ = Program(source).bind({})
    with pytest.raises(ai.OutOfOrderError) as info:
        model.trace(torch.randn(2, 4), fn)
    assert "<unknown line>" not in str(info.value)
    assert ":3 (in f)" in str(info.value)


# --------------------------------------------------------------------------- compute budgets
def test_budget_stops_a_busy_loop_at_its_own_cpu_time(model):
    fn, clock = Program("async def f(m):\n    h = await m.transformer.h[0].output\n    while True:\n        pass\n"
                        ).bind({}, None, 0.2)
    t0 = time.monotonic()
    with pytest.raises(SandboxTimeout, match="compute budget of 0.2 s"):
        model.trace("Hello", fn)
    assert time.monotonic() - t0 < 5
    assert 0.2 <= clock.cpu < 1.0 and clock.depth == 0


def test_budget_counts_spawned_tasks_and_many_firings(model):
    src = '''
from asyncinterp import spawn
async def spin():
    while True:
        pass
async def f(m):
    t = await spawn(spin())
    await m.transformer.h[0].output
    return await t
'''
    fn, clock = Program(src, entry="f").bind({}, None, 0.2)
    with pytest.raises(SandboxTimeout, match="compute budget"):
        model.trace("Hello", fn)
    # short spins in every step of a generation add up: cut in a later step
    src2 = '''
async def f(m):
    k = 0
    async for step in m.steps():
        await m.transformer.h[0].output
        i = 0
        while i < 100000:
            i += 1
        k += 1
    return k
'''
    fn, clock = Program(src2).bind({}, None, 0.15)
    with pytest.raises(SandboxTimeout, match="compute budget"):
        model.generate("Hello", fn, max_new_tokens=100)
    assert clock.cpu >= 0.15


def test_budget_is_not_consumed_by_waiting(model):
    """Only the code's own resumptions count: a cheap intervention over a whole generation uses little."""
    fn, clock = Program("async def f(m):\n    async for s in m.steps():\n        await m.transformer.h[1].output\n"
                        "    return 1\n").bind({}, None, 10.0)
    model.generate("Hello", fn, max_new_tokens=5)
    assert 0 < clock.cpu < 0.5 and clock.wall > 0


def test_meter_credit_is_other_requests_time():
    from asyncinterp.serve.scheduling.batcher import Ledger, Meter
    ledger = Ledger()
    a, b = Meter(), Meter()
    a.attach(ledger)
    b.attach(ledger)
    a.resume()
    time.sleep(0.05)
    assert b.credit() >= 0.04 and a.credit() < 0.01      # counted while it runs, for the others only
    a.pause()
    b.resume()
    b.resume()                                            # nested: counted once
    time.sleep(0.02)
    b.pause()
    b.pause()
    assert 0.04 <= b.credit() < a.wall + 0.01
    assert 0.015 <= a.credit() and ledger.held >= a.wall + b.wall - 1e-9
    c = Meter()
    c.attach(ledger)
    assert c.credit() == 0.0                              # only time after it was queued


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_standard_names_and_semantic_points_in_submitted_code(family):
    """Submitted code speaks the same names as local code (layers, attn, mlp; resid_*, attn.q/k/v/pattern,
    mlp.pre/post, logits): reads equal the local run, writes take effect, parameters stay out of reach."""
    model = tiny(family)
    src = '''
async def f(m, layer):
    pre = await m.layers[layer].resid_pre
    q = await m.layers[layer].attn.q
    p = await m.layers[layer].attn.pattern
    mid = await m.layers[layer].resid_mid
    act = await m.layers[layer].mlp.post
    m.layers[layer].resid_post = (await m.layers[layer].resid_post) * 0.5
    return {"pre": pre, "q": q, "p": p, "mid": mid, "act": act, "logits": await m.logits}
'''
    out, _ = run_submitted(model, src, {"layer": 0})

    async def local(m, layer):
        pre = (await m.layers[layer].resid_pre).clone()
        q = (await m.layers[layer].attn.q).clone()
        p = (await m.layers[layer].attn.pattern).clone()
        mid = (await m.layers[layer].resid_mid).clone()
        act = (await m.layers[layer].mlp.post).clone()
        m.layers[layer].resid_post = (await m.layers[layer].resid_post) * 0.5
        return {"pre": pre, "q": q, "p": p, "mid": mid, "act": act, "logits": (await m.logits).clone()}

    ref = model.trace("Hello there world", lambda m: local(m, 0))
    async def logits(m):
        return (await m.logits).clone()

    plain = model.trace("Hello there world", logits)
    for k in ref:
        assert torch.equal(out[k], ref[k]), k
    assert not torch.allclose(out["logits"], plain)      # the write went through
    for expr in ("m.layers[0].attn.weight", "m.layers[0].mlp.training", "m.layers.weight"):
        with pytest.raises(AttributeError, match="no submodule or hook point"):
            run_submitted(model, f"async def f(m):\n    return {expr}\n")
