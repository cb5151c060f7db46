"""A finished run is freed by reference counting alone: nothing is left for the cyclic garbage collector.

Every run used to leave ~60 objects in reference cycles; generation-0
collections then ran every few traces, and a full collection with
transformers loaded takes ~200 ms, which a served request feels as a latency
spike. Each case runs once to warm caches, then once more with the collector
disabled, and asserts that ``gc.collect()`` finds nothing.
"""

import gc

import pytest
import torch

import asyncinterp as ai
from gc_helpers import settle_garbage


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(4)])


def _garbage_after(run_once):
    run_once()   # warm-up: lazily built caches (call order, checked functions) are not garbage
    settle_garbage()
    was = gc.isenabled()
    gc.disable()
    try:
        gc.set_debug(gc.DEBUG_SAVEALL)
        run_once()
        gc.collect()
        found = [type(o).__name__ for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was:
            gc.enable()
    return found


X = torch.randn(3, 8)


async def read_and_edit(m):
    h = await m[1].output
    h[:] = 0
    return (await m[3].output).sum().item()


async def record(m):
    return (await m[0].output).clone()


async def replace_input(m):
    x = await m[2].input
    m[2].input = x * 2
    await m[3].output


async def gathered(m):
    a, b = await ai.gather(m[1][1].output, m[2][0].output)
    return float(a.sum() + b.sum())


async def skipper(m):
    m[1].skip(torch.zeros(3, 8))
    await m[2].output


async def stopper(m):
    await m[1].output
    m.stop()


def _several_invokes(model):
    fut = ai.Future()

    async def a(m):
        fut.set_result((await m[1].output).clone())

    async def b(m):
        h = await m[1].output
        h[:] = await fut
        return (await m[3].output).sum().item()

    with model.trace() as tr:
        tr.invoke(X[:1], a)
        p = tr.invoke(X[1:], b)
    return p.result


CASES = {
    "plain forward": lambda model: model.trace(X),
    "read and in-place edit": lambda model: model.trace(X, read_and_edit),
    "clone a value": lambda model: model.trace(X, record),
    "replace an input": lambda model: model.trace(X, replace_input),
    "gather": lambda model: model.trace(X, gathered),
    "skip": lambda model: model.trace(X, skipper),
    "stop": lambda model: model.trace(X, stopper),
    "invokes sharing a future": _several_invokes,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_finished_run_leaves_no_cycles(case):
    model = ai.wrap(_net())
    assert _garbage_after(lambda: CASES[case](model)) == []


def test_cache_and_grad_leave_no_cycles():
    model = ai.wrap(_net())

    assert _garbage_after(lambda: ai.cache(model, X, "*")) == []

    async def grads(m):
        g = await ai.spawn(m[1].output.grad)
        out = await m[3].output
        await m.backward(out.sum())
        return (await g).sum().item()

    assert _garbage_after(lambda: model.trace(X.requires_grad_(), grads)) == []


def test_atrace_leaves_no_cycles():
    import anyio
    model = ai.wrap(_net())
    assert _garbage_after(lambda: anyio.run(model.atrace, X, read_and_edit)) == []


def test_language_model_trace_leaves_no_cycles():
    lm = ai.models.tiny("llama")

    async def last_logits(m):
        return (await m.lm_head.output)[:, -1].argmax(-1)

    assert _garbage_after(lambda: lm.trace(["hello world", "a b c"], last_logits)) == []
