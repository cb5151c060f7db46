"""Gradients in submitted code, through a real server: co-batched requests get their solo results, bit for bit.

Each intervention below is an ordinary ``async def``: the test runs it locally on the same model
(``model.trace``) and sends the same function to the server (``Client.trace``, its source travels). The server
coalesces concurrent gradient requests into one forward with autograd on; every backward one of them starts
resumes only its own gradient points and leaves the shared graph to the others.
"""

import asyncio
import functools
import time

import pytest
import torch

from asyncinterp.serve import AsyncClient, RemoteError, Server
from asyncinterp.serve.sandbox import Program
from serve_helpers import model, one_thread  # noqa: F401 - fixtures are found by name
from test_serve_http import Live

KEY = "grad-key"
# 5 GPT-2 tokens each: with exact=True they share a forward without padding
SAME_LEN = ["The cat sat on the", "A dog ran into a", "One two three four five", "Paris is the capital of"]
N = 3   # requests per batch: the batch closes as soon as N have arrived (max_wait_ms is long)


async def saliency(m):
    import torch
    h = await m.transformer.h[0].output
    out = await m.lm_head.output
    (g,) = torch.autograd.grad(out[:, -1, 0].sum(), h)
    return g


async def grad_point(m, scale=1.0):
    from asyncinterp import spawn
    g = await spawn(m.transformer.h[1].output.grad)
    out = await m.lm_head.output
    await m.backward(out[:, -1].pow(2).sum() * scale)
    return await g


async def halve_grad(m):
    from asyncinterp import spawn

    async def halve():
        g = await m.transformer.h[1].output.grad
        g.mul_(0.5)                      # changes what flows on to layer 0, in this request's backward only

    await spawn(halve())
    low = await spawn(m.transformer.h[0].output.grad)
    out = await m.lm_head.output
    await m.backward(out[:, -1].sum())
    return await low


async def two_losses(m):
    from asyncinterp import spawn
    first = await spawn(m.transformer.h[1].output.grad)     # binds to this request's 1st backward pass
    second = await spawn(m.transformer.h[1].output.grad)    # and to its 2nd
    out = await m.lm_head.output
    await m.backward(out[:, -1].sum(), retain_graph=True)
    await m.backward(out[:, -1].pow(2).sum())
    return await first, await second


async def waits_only(m):
    from asyncinterp import spawn
    g = await spawn(m.transformer.h[1].output.grad)      # never starts a backward of its own
    await m.lm_head.output
    return await g


async def many_backwards(m):
    import torch
    h = await m.transformer.h[0].output
    out = await m.lm_head.output
    n = 0
    while True:
        torch.autograd.grad(out[:, -1].sum(), h)
        n += 1


@pytest.fixture(scope="module")
def live(model):
    srv = Live(Server(model, api_keys=[KEY], allow_code=True, exact=True, max_batch=N, max_wait_ms=4000,
                      timeout=20, code_budget=0.5))
    yield srv
    srv.close()


def together(live, calls):
    """Send ``calls`` ((prompt, fn, params), ...) at once; returns results or RemoteErrors, and the batches run."""
    async def go():
        async with AsyncClient(live.url, api_key=KEY, timeout=60) as c:
            return await asyncio.gather(*[c.trace(p, fn, params=params) for p, fn, params in calls],
                                        return_exceptions=True)
    before = live.server.batcher.stats["batches"]
    with live.server.batcher.arrivals.expect(len(calls)):   # they are on their way together: one batch
        out = asyncio.run(asyncio.wait_for(go(), 120))
    return out, live.server.batcher.stats["batches"] - before


def local(model, prompt, fn, **params):
    return model.trace(prompt, functools.partial(fn, **params) if params else fn)


def test_co_batched_gradient_requests_equal_their_local_runs_bit_for_bit(model, live):
    calls = [(SAME_LEN[0], saliency, {}), (SAME_LEN[1], grad_point, {"scale": 1.0}),
             (SAME_LEN[2], grad_point, {"scale": 3.0})]
    params = list(model.module.parameters())
    for p in params:
        p.grad = None
    out, batches = together(live, calls)
    assert batches == 1 and live.server.batcher.stats["max_batch_seen"] >= N      # one shared forward
    assert all(p.grad is None for p in params)    # the server's backward passes accumulate into no parameter
    for (prompt, fn, params), got in zip(calls, out):
        assert not isinstance(got, BaseException), got
        want = local(model, prompt, fn, **params)
        assert got.shape == want.shape == (1, 5, 64)
        assert torch.equal(got, want), (prompt, fn.__name__)


def test_an_edited_gradient_flows_on_in_its_own_backward_only(model, live):
    calls = [(SAME_LEN[0], halve_grad, {}), (SAME_LEN[1], grad_point, {}), (SAME_LEN[3], halve_grad, {})]
    out, batches = together(live, calls)
    assert batches == 1
    for (prompt, fn, params), got in zip(calls, out):
        assert torch.equal(got, local(model, prompt, fn, **params)), (prompt, fn.__name__)


def test_several_backward_passes_bind_in_order_among_batch_mates(model, live):
    calls = [(SAME_LEN[0], two_losses, {}), (SAME_LEN[1], two_losses, {}), (SAME_LEN[2], grad_point, {})]
    out, batches = together(live, calls)
    assert batches == 1
    for (prompt, fn, params), got in zip(calls, out):
        want = local(model, prompt, fn, **params)
        if fn is two_losses:
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), prompt
            assert not torch.equal(got[0], got[1])
        else:
            assert torch.equal(got, want)


def test_a_gradient_cannot_read_a_batch_mates_backward(model, live):
    """A request that waits on a gradient point but starts no backward sees nothing of its batch-mates'
    backward passes (which compute that very gradient on the shared tensor): it fails as it would alone."""
    calls = [(SAME_LEN[0], waits_only, {}), (SAME_LEN[1], grad_point, {"scale": 2.0}),
             (SAME_LEN[2], saliency, {})]
    out, batches = together(live, calls)
    assert batches == 1
    assert isinstance(out[0], RemoteError) and out[0].status == 422
    assert "MissedHookPoint" in out[0].type and "m.backward(loss)" in str(out[0])
    assert torch.equal(out[1], local(model, SAME_LEN[1], grad_point, scale=2.0))
    assert torch.equal(out[2], local(model, SAME_LEN[2], saliency))


def test_backward_passes_count_on_the_compute_budget(model, live):
    t0 = time.monotonic()
    calls = [(SAME_LEN[0], many_backwards, {}), (SAME_LEN[1], saliency, {}), (SAME_LEN[2], grad_point, {})]
    out, batches = together(live, calls)
    assert isinstance(out[0], RemoteError) and out[0].status == 504
    assert "compute budget" in str(out[0])
    assert time.monotonic() - t0 < 30
    assert torch.equal(out[1], local(model, SAME_LEN[1], saliency))
    assert torch.equal(out[2], local(model, SAME_LEN[2], grad_point))


@pytest.mark.parametrize("body, match", [
    ("return (await m.transformer.h[0].output).grad", "tensor operation 'grad' is not available"),
    ("(await m.lm_head.output).sum().backward()", "tensor operation 'backward' is not available"),
    ("h = await m.transformer.h[0].output\n    out = await m.lm_head.output\n"
     "    torch.autograd.grad(out.sum(), h, create_graph=True)", "create_graph=True"),
    ("h = await m.transformer.h[0].output\n    torch.autograd.grad(h.sum(), [1.0])", "computed by this request"),
    ("h = await m.transformer.h[0].output\n    out = await m.lm_head.output\n"
     "    torch.autograd.grad(out.sum(), m.transformer.h[0])", "computed by this request"),
])
def test_what_stays_refused(model, body, match):
    fn, _ = Program(f"import torch\nasync def f(m):\n    {body}\n").bind({})
    with torch.enable_grad(), pytest.raises(Exception, match=match):
        model.trace(SAME_LEN[0], fn)


def test_gradient_requests_are_told_when_a_run_has_no_graph(model):
    """Generation runs without autograd: a gradient there is a clear error, not a silent zero."""
    fn, _ = Program("import torch\nasync def f(m):\n    h = await m.transformer.h[0].output\n"
                    "    return torch.autograd.grad(h.sum(), h)\n").bind({})
    with torch.no_grad(), pytest.raises(RuntimeError, match="has no autograd graph"):
        model.trace(SAME_LEN[0], fn)
