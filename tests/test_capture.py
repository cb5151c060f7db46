"""Capture (issue 21, "remote is local"): interventions travel as source with what they read; a dry run equals the local run."""

import math

import pytest
import torch

import asyncinterp as ai
from asyncinterp.serve import wire
from asyncinterp.client.capture import FORMAT, Capture, describe
from asyncinterp.serve.jobs.dryrun import dry_run
from asyncinterp.serve.jobs.job_wire import dumps_job, loads_job
from asyncinterp.serve.sandbox.rebuild import DescriptionRefused, checked, rebuild, trusted
from asyncinterp.serve.sandbox import SandboxRefused

SCALE = 0.5                       # a module-level constant the interventions read
LAYERS = [1, 3]


def halve(h):
    """A helper the interventions call (itself reading a constant and a module)."""
    return h * SCALE + math.sqrt(0.0)


async def scaled(m):
    for i in LAYERS:
        h = await m.layers[i].output
        m.layers[i].output = halve(h)
    return (await m.layers[5].output).clone()


def _same(a, b):
    assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def _local_and_dry(model, build):
    with model.trace() as local:
        build(local)
    run = model.trace()
    build(run)
    back = dry_run(model, run)
    return [inv.result for inv in local.invokes], [inv.result for inv in back.results]


def test_a_closure_over_a_steering_tensor(mlp):
    model = ai.wrap(mlp)
    steer = torch.randn(16)
    x = torch.randn(2, 8)

    async def steered(m):
        h = await m.layers[2].output
        m.layers[2].output = h + 3 * steer
        return (await m.layers[5].output).clone()

    local, dry = _local_and_dry(model, lambda run: run.invoke(x, steered))
    _same(local[0], dry[0])
    assert not torch.allclose(dry[0], model.trace(x, lambda_free_read))   # the steering did something


async def lambda_free_read(m):
    return (await m.layers[5].output).clone()


def test_a_module_constant_and_a_helper_function(mlp):
    model = ai.wrap(mlp)
    x = torch.randn(3, 8)
    local, dry = _local_and_dry(model, lambda run: run.invoke(x, scaled))
    _same(local[0], dry[0])
    desc = describe(scaled)
    names = [f["name"] for f in desc["functions"]]
    assert names == ["scaled", "halve"]
    assert desc["functions"][0]["values"]["LAYERS"] == ["L", [["=", 1], ["=", 3]]]
    assert desc["functions"][1]["modules"] == {"math": "math"}
    assert "abs" not in str(desc) and "range" not in str(desc["functions"][0]["values"])   # builtins stay home


def test_two_invokes_share_a_future_activation_patching(mlp):
    model = ai.wrap(mlp)
    clean, corrupted = torch.randn(1, 8), torch.randn(1, 8)

    def build(run):
        handoff = ai.Future()

        async def read_clean(m):
            handoff.set_result((await m.layers[2].output).clone())

        async def patch_corrupted(m):
            await m.layers[2].output
            m.layers[2].output = await handoff
            return (await m.layers[5].output).clone()

        run.invoke(clean, read_clean)
        run.invoke(corrupted, patch_corrupted)

    local, dry = _local_and_dry(model, build)
    _same(local[1], dry[1])
    _same(dry[1], model.trace(clean, lambda_free_read))   # patched at layer 2 = the clean run downstream
    run = model.trace()
    build(run)
    assert len(wire.unpackb(dumps_job(run.job))["capture"]["futures"]) == 1   # one future, shared


def test_generation_with_per_step_control_over_a_list_of_steps():
    lm = ai.models.tiny("llama")
    prompt = "The Eiffel Tower is in"
    chosen = [1, 3]
    boost = torch.zeros(lm.module.config.vocab_size)
    boost[7] = 1e4

    async def force_on_chosen(m):
        async for step in m.steps():
            logits = await m.lm_head.output
            if step in chosen:
                logits[:, -1] += boost
        return step

    local = lm.generate(prompt, force_on_chosen, max_new_tokens=5)
    run = lm.generate(max_new_tokens=5)
    run.invoke(prompt, force_on_chosen)
    back = dry_run(lm, run)
    assert back.results[-1].tokens.tolist() == local.tokens.tolist()
    assert [local.tokens.tolist()[i] for i in chosen] == [7, 7]
    assert back.results[-1].result == local.result


def test_a_closure_over_a_file_handle_is_a_client_side_type_error(mlp):
    model = ai.wrap(mlp)
    with open(__file__) as handle:
        async def reads_a_file(m):
            handle.readline()
            return await m.layers[1].output

        run = model.trace()
        run.invoke(torch.randn(1, 8), reads_a_file)
        with pytest.raises(TypeError, match=r"invoke 0 of the job: .*reads_a_file reads 'handle' \(.*line \d+\), "
                                            r"a _io.TextIOWrapper, which cannot travel"):
            dumps_job(run.job)


def test_a_tensor_referenced_twice_travels_once():
    big = torch.randn(256, 256)

    async def first(m):
        return big

    async def second(m):
        return big + pair[0]

    pair = [big, big]
    capture = Capture()
    capture.add(first)
    capture.add(second)
    once = len(wire.packb(capture.description()))
    assert len(capture.description()["tensors"]) == 1
    assert big.numel() * 4 < once < big.numel() * 4 + 4000     # one copy of the bytes, not three


def test_a_forged_or_tampered_description_is_refused():
    async def good(m):
        return 1

    desc = describe(good)

    def forged(**changes):
        fn = {**desc["functions"][0], **changes}
        return {**desc, "functions": [fn]}

    assert rebuild(desc, trusted)[0].__name__ == "good"
    with pytest.raises(DescriptionRefused, match="not one plain"):
        rebuild(forged(source="print('hi')\n"), trusted)
    with pytest.raises(DescriptionRefused, match="not one plain"):
        rebuild(forged(source="async def other(m):\n    return 1\n"), trusted)
    with pytest.raises(SandboxRefused):
        rebuild(forged(source="async def good(m):\n    return open('/etc/passwd').read()\n"), checked)
    with pytest.raises(DescriptionRefused, match="not a name"):
        rebuild(forged(values={"__builtins__": ["=", 1]}), trusted)
    with pytest.raises(DescriptionRefused, match="not allowed"):
        rebuild(forged(modules={"os": "os"}), trusted)
    deep = ["=", 1]
    for _ in range(40):
        deep = ["L", [deep]]
    with pytest.raises(DescriptionRefused, match="nests deeper"):
        rebuild(forged(values={"x": deep}), trusted)
    with pytest.raises(DescriptionRefused, match="out of range"):
        rebuild(forged(values={"x": ["R", 5]}), trusted)
    with pytest.raises(DescriptionRefused, match=rf"format 99 .*reads format {FORMAT}"):
        rebuild({**desc, "format": 99, "asyncinterp": "9.9"}, trusted)


def test_what_a_job_shares_is_shared_after_the_trip(mlp):
    model = ai.wrap(mlp)
    steer = torch.randn(16)

    async def a(m):
        return steer

    async def b(m):
        return steer

    run = model.trace()
    run.invoke(torch.randn(1, 8), a)
    run.invoke(torch.randn(1, 8), b)
    back = loads_job(dumps_job(run.job), compile_source=checked)
    fa, fb = back.invokes[0].fns[0], back.invokes[1].fns[0]
    assert fa.__globals__["steer"] is fb.__globals__["steer"]          # one tensor on the other side
    assert fa.__globals__["steer"] is not steer and torch.equal(fa.__globals__["steer"], steer)   # a fresh copy


def test_a_partial_with_keywords_travels(mlp):
    import functools
    model = ai.wrap(mlp)
    x = torch.randn(2, 8)

    async def add(m, vec=None):
        h = await m.layers[1].output
        m.layers[1].output = h + vec
        return (await m.layers[5].output).clone()

    fn = functools.partial(add, vec=torch.randn(16))
    local, dry = _local_and_dry(model, lambda run: run.invoke(x, fn))
    _same(local[0], dry[0])


def test_a_server_rebuilds_in_the_sandbox_and_gets_the_local_result(mlp):
    from asyncinterp.serve.sandbox.rebuild_sandbox import Sandboxed
    model = ai.wrap(mlp)
    x = torch.randn(2, 8)
    steer = torch.randn(16)

    async def steered(m):
        h = await m.layers[2].output
        m.layers[2].output = halve(h) + steer
        return (await m.layers[5].output).clone()

    run = model.trace()
    run.invoke(x, steered)
    back = loads_job(dumps_job(run.job), compile_source=Sandboxed())
    model.engine("trace").start(back).wait()
    _same(model.trace(x, steered), back.results[0].result)

    async def escapes(m):
        return open("/etc/passwd").read()

    run = model.trace()
    run.invoke(x, escapes)
    with pytest.raises(SandboxRefused, match="open"):
        loads_job(dumps_job(run.job), compile_source=Sandboxed())


def test_a_future_shared_between_invokes_works_in_the_sandbox(mlp):
    from asyncinterp.serve.sandbox.rebuild_sandbox import Sandboxed
    model = ai.wrap(mlp)
    clean, corrupted = torch.randn(1, 8), torch.randn(1, 8)
    handoff = ai.Future()

    async def read_clean(m):
        handoff.set_result((await m.layers[2].output).clone())

    async def patch_corrupted(m):
        await m.layers[2].output
        m.layers[2].output = await handoff
        return (await m.layers[5].output).clone()

    run = model.trace()
    run.invoke(clean, read_clean)
    run.invoke(corrupted, patch_corrupted)
    back = loads_job(dumps_job(run.job), compile_source=Sandboxed())
    model.engine("trace").start(back).wait()
    _same(back.results[1].result, model.trace(clean, lambda_free_read))


def even(n):
    return True if n == 0 else odd(n - 1)


def odd(n):
    return False if n == 0 else even(n - 1)


def test_helpers_calling_each_other_are_captured_once(mlp):
    model = ai.wrap(mlp)
    x = torch.randn(1, 8)

    async def parity(m):
        h = await m.layers[1].output
        return h * (2.0 if even(4) else -1.0)

    local, dry = _local_and_dry(model, lambda run: run.invoke(x, parity))
    _same(local[0], dry[0])
    assert sorted(f["name"] for f in describe(parity)["functions"]) == ["even", "odd", "parity"]


def test_what_a_server_would_refuse_shows_in_the_dry_run(mlp):
    import os
    model = ai.wrap(mlp)

    async def uses_os(m):
        return os.getcwd()

    async def writes_outer(m):
        nonlocal count
        count += 1

    async def opens(m):
        return open("notes.txt").read()

    async def dunder(m):
        return __file__

    count = 0
    with pytest.raises(TypeError, match=r"uses_os reads 'os' .*module 'os' is not one the server allows"):
        describe(uses_os)
    with pytest.raises(TypeError, match=r"writes_outer assigns the enclosing function's variable 'count'"):
        describe(writes_outer)
    with pytest.raises(TypeError, match=r"dunder reads '__file__'"):
        describe(dunder)
    run = model.trace()
    run.invoke(torch.randn(1, 8), opens)
    with pytest.raises(SandboxRefused, match="open"):
        dry_run(model, run)


def test_source_that_does_not_parse_here_names_both_pythons():
    async def good(m):
        return 1

    desc = describe(good)
    desc["functions"][0]["source"] = "async def good(m):\n    return 1 +\n"
    with pytest.raises(DescriptionRefused, match=r"does not parse here .*written on Python .*read on Python"):
        rebuild(desc, trusted)
