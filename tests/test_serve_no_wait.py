"""No wait for nobody (issue 30): a request on an idle engine starts at once; company is waited for only when
it is on its way.

Before, a lone request on an idle server waited the whole batching window (``max_wait_ms``) for batch-mates
that never came. Now a batch waits only while other requests are known to be on their way (received by the
server, not yet submitted: ``Batcher.arrivals``), and requests that come while a forward runs join the next
forward, as continuous batching does. The windows below are long (seconds) so that a wait cannot hide.
"""

import asyncio
import threading
import time

import httpx
import torch

from asyncinterp.serve import AsyncClient, Batcher, Server
from serve_helpers import model, one_thread  # noqa: F401 - fixtures are found by name
from test_serve_http import Live

LONG_WAIT_MS = 4000
KEY = "k"


async def last_logits(m):
    return (await m.lm_head.output)[:, -1].clone()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_a_lone_request_on_an_idle_engine_starts_at_once(model):
    async def main():
        async with Batcher(model, max_batch=8, max_wait_ms=LONG_WAIT_MS) as b:
            await b.trace("warm up", last_logits)
            t0 = time.monotonic()
            out = await b.trace("The cat sat on the", last_logits)
            return out, time.monotonic() - t0
    out, took = run(main())
    assert torch.equal(out, model.trace("The cat sat on the", last_logits))
    assert took < LONG_WAIT_MS / 1000 / 2, f"a lone request waited {took:.2f} s for company that never came"


def test_requests_that_come_while_a_forward_runs_join_the_next_one(model):
    entered, release = threading.Event(), threading.Event()

    async def blocker(m):
        h = await m.transformer.h[0].output
        entered.set()
        release.wait(30)        # the engine is busy while the others arrive
        return h.sum().item()

    prompts = ["A dog ran into a", "One two three four five", "Paris is the capital of"]

    async def main():
        async with Batcher(model, max_batch=8, max_wait_ms=LONG_WAIT_MS) as b:
            first = asyncio.ensure_future(b.trace("The cat sat on the", blocker))
            while not entered.is_set():
                await asyncio.sleep(0.005)
            rest = [asyncio.ensure_future(b.trace(p, last_logits)) for p in prompts]
            await asyncio.sleep(0.05)   # all three are queued behind the running forward
            release.set()
            t0 = time.monotonic()
            outs = await asyncio.gather(*rest)
            await first
            return outs, dict(b.stats), time.monotonic() - t0
    outs, stats, took = run(main())
    assert stats["batches"] == 2 and stats["max_batch_seen"] == 3, stats     # the three shared the next forward
    assert took < LONG_WAIT_MS / 1000 / 2, took
    for p, got in zip(prompts, outs):
        assert torch.allclose(got, model.trace(p, last_logits), atol=1e-5, rtol=1e-5), p


def test_requests_declared_on_their_way_share_one_forward(model):
    prompts = ["The cat sat on the", "A dog ran into a", "One two three four five", "Paris is the capital of"]

    async def main():
        async with Batcher(model, max_batch=8, max_wait_ms=LONG_WAIT_MS, exact=True) as b:
            with b.arrivals.expect(len(prompts)):
                outs = await asyncio.gather(*[b.trace(p, last_logits) for p in prompts])
            return outs, dict(b.stats), b.arrivals.count
    outs, stats, left = run(main())
    # the batch started when the fourth came (not at the window's end), and nothing stays counted
    assert stats["batches"] == 1 and stats["max_batch_seen"] == 4 and left == 0, stats
    for p, got in zip(prompts, outs):
        assert torch.equal(got, model.trace(p, last_logits)), p


def test_expect_takes_a_positive_count(model):
    b = Batcher(model)
    try:
        for bad in (0, -1, 1.5):
            try:
                with b.arrivals.expect(bad):
                    pass
            except ValueError as exc:
                assert "positive number of requests" in str(exc)
            else:
                raise AssertionError(f"expect({bad!r}) was accepted")
    finally:
        b.close()


def test_a_lone_http_request_is_answered_without_the_window_and_refusals_leave_no_arrival(model):
    srv = Live(Server(model, api_keys=[KEY], max_wait_ms=LONG_WAIT_MS, max_batch=8))
    try:
        async def go():
            async with AsyncClient(srv.url, api_key=KEY, timeout=30) as c:
                await c.trace("warm up", "read", params={"module": "transformer.h.0"})
                t0 = time.monotonic()
                out = await c.trace("The cat sat on the", "read", params={"module": "transformer.h.0"})
                return out, time.monotonic() - t0
        out, took = asyncio.run(go())
        assert torch.is_tensor(out)
        assert took < LONG_WAIT_MS / 1000 / 2, f"a lone HTTP request waited {took:.2f} s"
        # refused requests (a broken body, a wrong key, an unknown intervention) never count as on their way
        with httpx.Client(base_url=srv.url, timeout=10) as h:
            assert h.post("/v1/trace", content=b"\x93not msgpack",
                          headers={"authorization": f"Bearer {KEY}"}).status_code == 400
            assert h.post("/v1/trace", content=b"{}", headers={"authorization": "Bearer wrong"}).status_code == 401
        assert srv.server.batcher.arrivals.count == 0
        t0 = time.monotonic()
        asyncio.run(go())
        assert time.monotonic() - t0 < LONG_WAIT_MS / 1000, "a refused request left an arrival behind"
    finally:
        srv.close()
