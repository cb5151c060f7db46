"""A job is the description of the work: built once, frozen, comparable, bytes and back; engines take it."""

import textwrap

import pytest
import torch

import asyncinterp as ai
from asyncinterp.serve.jobs.job_wire import dumps_job, loads_job
from asyncinterp.client.wire import WireError
from conftest import hook_count


async def zero_layer_one(m):
    h = await m.layers[1].output
    h[:] = 0
    return (await m.layers[2].output).clone()


async def read_layer_two(m):
    return (await m.layers[2].output).clone()


def _reference(mlp, x, zero):
    """layers[2]'s output of ``mlp(x)``, with layers[1]'s output zeroed or not, by hand-written hooks."""
    box = {}

    def ablate(mod, args, out):
        if zero:
            out[:] = 0

    def read(mod, args, out):
        box["out"] = out.clone()
    handles = [mlp.layers[1].register_forward_hook(ablate), mlp.layers[2].register_forward_hook(read)]
    try:
        mlp(x)
    finally:
        for h in handles:
            h.remove()
    return box["out"]


def _build(model, x, y):
    run = model.trace(on_error="continue")
    run.invoke(x, zero_layer_one)
    run.invoke(y, read_layer_two)
    return run


def test_a_trace_builds_a_frozen_job_that_no_longer_changes(mlp):
    model = ai.wrap(mlp)
    x, y = torch.randn(2, 8), torch.randn(3, 8)
    run = _build(model, x, y)
    job = run.job
    assert isinstance(job, ai.Job) and job.kind == "trace" and job.on_error == "continue"
    assert [spec.fns for spec in job.invokes] == [(zero_layer_one,), (read_layer_two,)]
    assert job.invokes[0].input is x and job.results == tuple(run.invokes)
    with pytest.raises(AttributeError):
        job.on_error = "stop"
    with pytest.raises(AttributeError):
        job.invokes[0].fns = ()
    with pytest.raises(TypeError):
        job.generation["max_new_tokens"] = 3          # mappings of a job are read-only
    with pytest.raises(RuntimeError, match="already submitted"):
        run.invoke(x, read_layer_two)
    run.run()
    assert run.job is job
    with pytest.raises(RuntimeError, match="already run"):
        run.run()


def test_jobs_compare_by_what_is_asked_not_where_results_go(mlp):
    model = ai.wrap(mlp)
    x, y = torch.randn(2, 8), torch.randn(3, 8)
    a, b = _build(model, x, y).job, _build(model, x, y).job
    assert a == b and a.results != b.results
    assert a != a.replace(on_error="stop")
    assert a != a.replace(invokes=a.invokes[:1], results=a.results[:1])


def test_an_engine_runs_the_job_a_trace_built(mlp):
    model = ai.wrap(mlp)
    x, y = torch.randn(2, 8), torch.randn(3, 8)
    job = _build(model, x, y).job
    run = model.engine("trace").start(job)
    assert isinstance(run, ai.Run) and run.job is job
    run.wait()
    first, second = job.results
    assert torch.allclose(first.result, _reference(mlp, x, zero=True), atol=1e-6)   # batched: last bits
    assert torch.allclose(second.result, _reference(mlp, y, zero=False), atol=1e-6)
    assert hook_count(mlp) == 0


def _trusted_compile(spec):
    """Test-only compiler for a job read back on the same side (a server uses the sandbox's)."""
    namespace = {}
    exec(compile(textwrap.dedent(spec["source"]), "<job>", "exec"), namespace)
    return namespace[spec["entry"]]


def test_a_job_turns_into_bytes_and_back_and_gives_the_same_results(mlp):
    model = ai.wrap(mlp)
    x, y = torch.randn(2, 8), torch.randn(3, 8)
    local = _build(model, x, y)
    local.run()
    data = dumps_job(local.job)
    assert isinstance(data, bytes)
    back = loads_job(data, _trusted_compile)
    assert back.kind == "trace" and back.on_error == "continue" and len(back.invokes) == 2
    assert [fn.__name__ for spec in back.invokes for fn in spec.fns] == ["zero_layer_one", "read_layer_two"]
    assert torch.equal(back.invokes[1].input, y)
    model.engine("trace").start(back).wait()
    for mine, theirs in zip(local.invokes, back.results):
        assert torch.equal(mine.result, theirs.result)


def test_a_job_that_cannot_travel_says_what_and_where(mlp):
    model = ai.wrap(mlp)
    limit = 3

    async def closes_over(m):
        return (await m.layers[limit].output)

    run = model.trace()
    run.invoke(torch.randn(1, 8), read_layer_two)
    run.invoke(torch.randn(1, 8), closes_over)
    data = dumps_job(run.job)   # a closure travels (captured, see tests/test_capture.py) ...
    with pytest.raises(WireError, match="read it with loads_job.data, compile_source"):
        loads_job(data, _trusted_compile)   # ... but not to a reader that takes self-contained source only
    run = model.trace()
    run.invoke(torch.randn(1, 8), read_layer_two)
    run.context["file"] = open(__file__)
    try:
        with pytest.raises(TypeError, match="this job cannot travel"):
            dumps_job(run.job)
    finally:
        run.context["file"].close()
    with pytest.raises(WireError, match="not a job"):
        loads_job(ai.serve.wire.packb({"format": 99}), _trusted_compile)


def test_edits_are_the_first_invoke_and_indices_never_change(mlp):
    async def ablate(m):
        (await m.layers[1].output)[:] = 0

    model = ai.wrap(mlp).edit(ablate)
    run = model.trace()
    inv = run.invoke(torch.randn(2, 8), read_layer_two)
    assert inv.index == 1                                 # set when added, not renumbered at run time
    job = run.job
    assert job.invokes[0].background and job.invokes[0].input is None
    run.run()
    assert inv.index == 1 and torch.allclose(inv.result, _reference(mlp, job.invokes[1].input, zero=True), atol=1e-6)


def test_a_generation_job_carries_its_options():
    pytest.importorskip("transformers")
    lm = ai.models.tiny("llama")
    run = lm.generate(max_new_tokens=3, stop=["x"])
    run.invoke("hello", read_first_layer)
    job = run.job
    assert job.kind == "generate" and job.generation == {"max_new_tokens": 3, "stop": ["x"]}
    run.run()
    assert len(run.invokes[0].tokens) <= 3


async def read_first_layer(m):
    return (await m.model.layers[0].output).shape


def test_an_edited_copy_runs_its_jobs_with_its_own_envoys(mlp):
    model = ai.wrap(mlp)
    x = torch.randn(2, 8)

    async def who(m):
        await m.layers[2].output
        return m

    assert model.trace(x, who) is model                    # the original's engine exists now

    async def ablate(m):
        (await m.layers[1].output)[:] = 0

    edited = model.edit(ablate)
    assert edited.engine("trace").model is edited and model.engine("trace").model is model
    assert edited.trace(x, who) is edited
    assert torch.equal(edited.trace(x, read_layer_two), _reference(mlp, x, zero=True))
    assert torch.equal(model.trace(x, read_layer_two), _reference(mlp, x, zero=False))
