"""In-process dynamic batching: coalescing, isolation, timeouts, cancellation, generation, backends."""

import asyncio
import functools
import threading
import time

import pytest
import torch

import asyncinterp as ai
from asyncinterp.serve import Batcher, BatcherClosed, BatcherFull, emit
from serve_helpers import model, one_thread  # noqa: F401 - fixtures are found by name

# Prompts of 5 GPT-2 tokens each (with exact=True they share a forward without padding).
# Tests that assert how requests were grouped use max_batch = their number of requests and a long
# max_wait_ms: the batch then closes as soon as all have arrived, however slow the machine is.
SAME_LEN = ["The cat sat on the", "A dog ran into a", "One two three four five", "Paris is the capital of",
            "I like green tea and", "We went to the big", "She said that he was", "It is a very good"]
MIXED = ["Hello", "The Eiffel Tower is in the city of", "a b c", "Once upon a time there", "x y z w v u t s r q"]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def last_logits(m):
    return (await m.lm_head.output)[:, -1].clone()


async def read_layer(m, layer=0):
    return (await m.transformer.h[layer].output)[:, -1].clone()


def test_prompts_have_equal_length(model):
    assert {len(model.tokenizer(p)["input_ids"]) for p in SAME_LEN} == {5}


def test_concurrent_requests_share_one_forward_and_equal_solo_runs(model):
    async def main():
        async with Batcher(model, max_batch=len(SAME_LEN), max_wait_ms=5000, exact=True) as b:
            with b.arrivals.expect(b.max_batch):   # these requests are on their way together
                res = await asyncio.gather(*[b.trace(p, last_logits) for p in SAME_LEN])
            return res, dict(b.stats)
    res, stats = run(main())
    assert stats["batches"] == 1 and stats["max_batch_seen"] == len(SAME_LEN)
    for p, r in zip(SAME_LEN, res):
        assert torch.equal(r, model.trace(p, last_logits)), p   # bit-equal


def test_padded_batches_match_solo_runs_up_to_rounding(model):
    async def main():
        async with Batcher(model, max_batch=len(MIXED), max_wait_ms=5000) as b:
            with b.arrivals.expect(b.max_batch):   # these requests are on their way together
                res = await asyncio.gather(*[b.trace(p, last_logits) for p in MIXED])
            return res, b.stats["batches"]
    res, batches = run(main())
    assert batches == 1
    for p, r in zip(MIXED, res):
        solo = model.trace(p, last_logits)
        assert torch.allclose(r, solo, atol=1e-5, rtol=1e-5)
        assert torch.equal(r.argmax(-1), solo.argmax(-1))


def test_other_requests_edits_and_errors_never_change_a_result(model):
    """Same batch composition, with and without hostile neighbours: my result is bit-identical."""
    async def vandal(m):
        h = await m.transformer.h[0].output
        h.mul_(1000)                                   # its own rows only
        m.transformer.h[1].output = torch.zeros_like(await m.transformer.h[1].output)
        raise RuntimeError("vandal")

    async def quiet(m):
        await m.transformer.h[0].output
        return None

    async def main(neighbour):
        async with Batcher(model, max_batch=2 * len(MIXED), max_wait_ms=5000) as b:
            tasks = [b.trace(p, last_logits if i % 2 == 0 else neighbour) for i, p in enumerate(MIXED * 2)]
            with b.arrivals.expect(b.max_batch):   # these requests are on their way together
                return await asyncio.gather(*tasks, return_exceptions=True)

    hostile, calm = run(main(vandal)), run(main(quiet))
    for i in range(0, len(hostile), 2):
        assert torch.equal(hostile[i], calm[i])
    assert all(isinstance(hostile[i], RuntimeError) and str(hostile[i]) == "vandal" for i in range(1, len(hostile), 2))


def test_raising_interventions_fail_only_their_requests(model):
    async def bad(m, i):
        await m.transformer.h[1].output
        raise ValueError(f"request {i} failed")

    async def main():
        async with Batcher(model, max_batch=8, max_wait_ms=50, exact=True) as b:
            calls = [b.trace(p, functools.partial(bad, i=i) if i % 5 == 0 else last_logits)
                     for i, p in enumerate(SAME_LEN * 5)]
            with b.arrivals.expect(b.max_batch):   # these requests are on their way together
                return await asyncio.gather(*calls, return_exceptions=True)
    res = run(main())
    for i, (p, r) in enumerate(zip(SAME_LEN * 5, res)):
        if i % 5 == 0:
            assert isinstance(r, ValueError) and str(r) == f"request {i} failed"
        else:
            assert torch.equal(r, model.trace(p, last_logits))


def test_timeout_ends_only_that_request_and_closes_its_intervention(model):
    closed = []

    async def slow(m):
        try:
            for layer in range(2):
                await m.transformer.h[layer].output
                time.sleep(0.3)                   # blocks the forward: the request's time runs out
            await m.lm_head.output
            return "finished"
        finally:
            closed.append(True)

    async def main():
        async with Batcher(model, max_batch=8, max_wait_ms=50, exact=True) as b:
            t0 = time.monotonic()
            with b.arrivals.expect(b.max_batch):   # these requests are on their way together
                res = await asyncio.gather(b.trace(SAME_LEN[0], slow, timeout=0.15),
                                           *[b.trace(p, last_logits) for p in SAME_LEN[1:4]], return_exceptions=True)
            return res, time.monotonic() - t0
    res, elapsed = run(main())
    assert isinstance(res[0], TimeoutError)
    assert closed == [True]
    for p, r in zip(SAME_LEN[1:4], res[1:]):
        assert torch.equal(r, model.trace(p, last_logits))


def test_cancel_mid_forward_closes_that_intervention_only(model):
    running = threading.Event()
    log = []

    async def victim(m):
        try:
            await m.transformer.h[0].output
            running.set()
            time.sleep(0.3)                      # the caller is cancelled meanwhile
            await m.transformer.h[1].output
            log.append("reached layer 1")
            return "done"
        finally:
            log.append("closed")

    async def main():
        async with Batcher(model, max_batch=8, max_wait_ms=50, exact=True) as b:
            v = asyncio.ensure_future(b.trace(SAME_LEN[0], victim))
            others = [asyncio.ensure_future(b.trace(p, last_logits)) for p in SAME_LEN[1:5]]
            while not running.is_set():
                await asyncio.sleep(0.005)
            v.cancel()
            with b.arrivals.expect(b.max_batch):   # these requests are on their way together
                res = await asyncio.gather(*others)
            with pytest.raises(asyncio.CancelledError):
                await v
            return res
    res = run(main())
    assert log == ["closed"]                      # closed at the next hook point, never resumed
    for p, r in zip(SAME_LEN[1:5], res):
        assert torch.equal(r, model.trace(p, last_logits))


def test_cancelled_while_queued_never_runs(model):
    started = []
    gate = threading.Event()

    async def blocker(m):
        await m.transformer.h[0].output
        gate.wait(5)

    async def never(m):
        started.append(True)
        return await m.lm_head.output

    async def main():
        async with Batcher(model, max_batch=1, max_wait_ms=0) as b:
            first = asyncio.ensure_future(b.trace(SAME_LEN[0], blocker))
            await asyncio.sleep(0.1)
            queued = asyncio.ensure_future(b.trace(SAME_LEN[1], never))
            await asyncio.sleep(0.05)
            assert b.queue_size() == 1
            queued.cancel()
            await asyncio.sleep(0.05)
            assert b.queue_size() == 0
            gate.set()
            await first
            ok = await b.trace(SAME_LEN[2], last_logits)
            return ok
    assert run(main()) is not None
    assert started == []


def test_full_queue_and_closed_batcher(model):
    gate = threading.Event()

    async def blocker(m):
        await m.transformer.h[0].output
        gate.wait(5)

    async def main():
        b = Batcher(model, max_batch=1, max_wait_ms=0, max_queue=2)
        first = asyncio.ensure_future(b.trace(SAME_LEN[0], blocker))
        await asyncio.sleep(0.1)
        queued = [asyncio.ensure_future(b.trace(p, last_logits)) for p in SAME_LEN[1:3]]
        await asyncio.sleep(0.05)
        with pytest.raises(BatcherFull, match="max_queue=2"):
            await b.trace(SAME_LEN[3], last_logits)
        gate.set()
        await first
        with b.arrivals.expect(b.max_batch):   # these requests are on their way together
            await asyncio.gather(*queued)
        await b.aclose()
        with pytest.raises(BatcherClosed):
            await b.trace(SAME_LEN[0], last_logits)
    run(main())


def test_close_fails_queued_requests(model):
    gate = threading.Event()

    async def blocker(m):
        await m.transformer.h[0].output
        gate.wait(5)

    async def main():
        b = Batcher(model, max_batch=1, max_wait_ms=0)
        first = asyncio.ensure_future(b.trace(SAME_LEN[0], blocker))
        await asyncio.sleep(0.1)
        queued = asyncio.ensure_future(b.trace(SAME_LEN[1], last_logits))
        await asyncio.sleep(0.05)
        closing = asyncio.ensure_future(b.aclose())
        await asyncio.sleep(0.05)
        gate.set()
        await closing
        with pytest.raises(BatcherClosed):
            await queued
        with pytest.raises(BatcherClosed):
            await first
    run(main())


def test_invalid_input_fails_alone(model):
    async def main():
        async with Batcher(model, max_batch=8, max_wait_ms=50) as b:
            with b.arrivals.expect(b.max_batch):   # these requests are on their way together
                return await asyncio.gather(b.trace(SAME_LEN[0], last_logits), b.trace([10**9], last_logits),
                                            b.trace(12345, last_logits), b.trace(SAME_LEN[1], last_logits),
                                            return_exceptions=True)
    res = run(main())
    assert isinstance(res[1], Exception) and isinstance(res[2], TypeError)
    assert torch.allclose(res[0], model.trace(SAME_LEN[0], last_logits), atol=1e-5)
    assert torch.allclose(res[3], model.trace(SAME_LEN[1], last_logits), atol=1e-5)


# --------------------------------------------------------------------------- generation
async def count_steps(m):
    seen = []
    async for step in m.steps():
        seen.append(step)
        emit(step)
    return seen


def test_generation_requests_leave_the_batch_at_their_own_length(model):
    lengths = [2, 5, 9, 1]
    done_at = {}

    async def one(b, p, n):
        g = await b.generate(p, count_steps, max_new_tokens=n)
        done_at[n] = time.monotonic()
        return g

    async def main():
        async with Batcher(model, max_batch=len(lengths), max_wait_ms=5000) as b:
            with b.arrivals.expect(b.max_batch):   # these requests are on their way together
                res = await asyncio.gather(*[one(b, p, n) for p, n in zip(SAME_LEN, lengths)])
            return res, b.stats["batches"]
    res, batches = run(main())
    assert batches == 1
    for p, n, g in zip(SAME_LEN, lengths, res):
        solo = model.generate(p, count_steps, max_new_tokens=n)
        assert g.tokens == solo.tokens.tolist() and len(g.tokens) == n
        assert g.text == solo.text
        assert g.result == solo.result == list(range(n))          # the step loop ended at its own length
        assert [e["value"] for e in g.emitted] == list(range(n))
    assert done_at[2] < done_at[9] and done_at[1] < done_at[5]    # short requests delivered early


def test_generation_ending_at_eos_matches_solo(model):
    eos = model.tokenizer.eos_token_id

    async def stop_at(m, k):
        n = 0
        async for step in m.steps():
            logits = await m.logits
            if step == k:
                logits[:, eos] = 1e9                   # force end-of-sequence at step k
            n += 1
        return n

    async def main():
        async with Batcher(model, max_batch=8, max_wait_ms=100) as b:
            with b.arrivals.expect(b.max_batch):   # these requests are on their way together
                return await asyncio.gather(*[b.generate(p, functools.partial(stop_at, k=k), max_new_tokens=8)
                                              for p, k in zip(SAME_LEN, [1, 3, 10])])
    res = run(main())
    for p, k, g in zip(SAME_LEN, [1, 3, 10], res):
        solo = model.generate(p, functools.partial(stop_at, k=k), max_new_tokens=8)
        assert g.tokens == solo.tokens.tolist()
        assert g.result == solo.result
    assert res[0].tokens[-1] == eos and len(res[0].tokens) == 2 and res[0].result == 2
    assert len(res[2].tokens) == 8


def test_generation_ending_at_a_stop_string_matches_solo(model):
    prompts = ["The cat sat on the", "Once upon a time", "Paris is the capital of"]
    stop = [" Priest"]                                # the third prompt's third token; the others never stop

    async def count(m):
        n = 0
        async for _ in m.steps():
            await m.logits
            n += 1
        return n

    async def main():
        async with Batcher(model, max_batch=len(prompts), max_wait_ms=5000) as b:
            with b.arrivals.expect(b.max_batch):   # these requests are on their way together
                res = await asyncio.gather(*[b.generate(p, count, max_new_tokens=8, stop=stop) for p in prompts])
            return res, dict(b.stats)
    res, stats = run(main())
    assert stats["batches"] == 1 and stats["max_batch_seen"] == len(prompts)
    for p, g in zip(prompts, res):
        solo = model.generate(p, count, max_new_tokens=8, stop=stop)
        assert g.tokens == solo.tokens.tolist() and g.text == solo.text and g.result == solo.result
    assert [len(g.tokens) for g in res] == [8, 8, 3] and res[2].text.endswith(stop[0]) and res[2].result == 3


def test_stream_generate_yields_tokens_and_emits_as_they_come(model):
    async def main():
        async with Batcher(model, max_batch=8, max_wait_ms=10) as b:
            events = []
            async for ev in b.stream_generate(SAME_LEN[0], count_steps, max_new_tokens=4):
                events.append(ev)
            return events
    events = run(main())
    kinds = [e["event"] for e in events]
    assert kinds.count("token") == 4 and kinds.count("emit") == 4 and kinds[-1] == "done"
    solo = model.generate(SAME_LEN[0], count_steps, max_new_tokens=4)
    assert [e["token"] for e in events if e["event"] == "token"] == solo.tokens.tolist()
    assert "".join(e["text"] for e in events if e["event"] == "token") == solo.text
    # each step's emit comes before that step's token
    assert kinds[:2] == ["emit", "token"]


def test_generation_cancel_mid_run_keeps_others(model):
    log = []

    async def slow_steps(m):
        try:
            async for step in m.steps():
                await m.transformer.h[0].output
                time.sleep(0.05)
                log.append(step)
        finally:
            log.append("closed")

    async def main():
        async with Batcher(model, max_batch=8, max_wait_ms=50) as b:
            victim = asyncio.ensure_future(b.generate(SAME_LEN[0], slow_steps, max_new_tokens=30))
            other = asyncio.ensure_future(b.generate(SAME_LEN[1], count_steps, max_new_tokens=12))
            await asyncio.sleep(0.4)
            victim.cancel()
            g = await other
            with pytest.raises(asyncio.CancelledError):
                await victim
            return g
    g = run(main())
    assert log[-1] == "closed" and len(log) < 25
    solo = model.generate(SAME_LEN[1], count_steps, max_new_tokens=12)
    assert g.tokens == solo.tokens.tolist() and g.result == list(range(12))


# --------------------------------------------------------------------------- other models and backends
class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])

    def forward(self, x):
        return self.layers(x)


def test_plain_wrapped_model_batches_by_trailing_shape():
    torch.manual_seed(0)
    wrapped = ai.wrap(MLP())

    async def mid(m):
        h = await m.layers[1].output
        h.mul_(2)
        return (await m.layers[2].output).clone()

    xs = [torch.randn(n, 16) for n in (1, 3, 2, 4)]

    async def main():
        async with Batcher(wrapped, max_batch=4, max_wait_ms=500) as b:
            with b.arrivals.expect(b.max_batch):   # these requests are on their way together
                res = await asyncio.gather(*[b.trace(x, mid) for x in xs],
                                           b.trace(torch.randn(2, 8), mid), return_exceptions=True)
            return res, b.stats["batches"]
    res, batches = run(main())
    assert batches == 2                                  # the [*, 8] input went to its own run
    for x, r in zip(xs, res):
        assert torch.allclose(r, wrapped.trace(x, mid), atol=1e-6)
    assert isinstance(res[-1], RuntimeError)             # wrong width: fails alone


def test_trio_backend(model):
    trio = pytest.importorskip("trio")

    async def main():
        b = Batcher(model, max_batch=8, max_wait_ms=50, exact=True)
        out = []

        async def one(p):
            out.append((p, await b.trace(p, last_logits)))
        async with trio.open_nursery() as n:
            for p in SAME_LEN[:4]:
                n.start_soon(one, p)
        with trio.fail_after(5):
            with pytest.raises(trio.TooSlowError):
                with trio.fail_after(0.01):
                    await b.trace(SAME_LEN[0], slow_forever)
        b.close()
        return out

    async def slow_forever(m):
        for layer in range(2):
            await m.transformer.h[layer].output
            time.sleep(0.1)

    for p, r in trio.run(main):
        assert torch.equal(r, model.trace(p, last_logits))


def test_emit_outside_a_batcher_is_a_no_op(model):
    async def f(m):
        emit(torch.ones(2))
        return (await m.transformer.h[0].output).shape

    assert model.trace(SAME_LEN[0], f) == (1, 5, 64)


def test_stop_in_one_request_ends_only_that_request(model):
    async def stopper(m):
        h = (await m.transformer.h[0].output)[:, -1].clone()
        m.stop()
        return h

    async def stop_then_wait(m):
        await m.transformer.h[0].output
        m.stop()
        return await m.lm_head.output          # never comes: the request was stopped

    async def main():
        async with Batcher(model, max_batch=8, max_wait_ms=50, exact=True) as b:
            with b.arrivals.expect(b.max_batch):   # these requests are on their way together
                return await asyncio.gather(b.trace(SAME_LEN[0], stopper), b.trace(SAME_LEN[1], last_logits),
                                            b.trace(SAME_LEN[2], stop_then_wait), b.trace(SAME_LEN[3], last_logits),
                                            return_exceptions=True)
    res = run(main())
    assert torch.equal(res[0], model.trace(SAME_LEN[0], stopper))
    assert torch.equal(res[1], model.trace(SAME_LEN[1], last_logits))
    assert isinstance(res[2], ai.RunStopped)
    with pytest.raises(ai.RunStopped):
        model.trace(SAME_LEN[2], stop_then_wait)
    assert torch.equal(res[3], model.trace(SAME_LEN[3], last_logits))


def test_stop_during_generation_keeps_tokens_so_far(model):
    async def stop_at_2(m):
        async for step in m.steps():
            await m.transformer.h[0].output
            if step == 2:
                m.stop()
                return step

    async def main():
        async with Batcher(model, max_batch=8, max_wait_ms=50) as b:
            with b.arrivals.expect(b.max_batch):   # these requests are on their way together
                return await asyncio.gather(b.generate(SAME_LEN[0], stop_at_2, max_new_tokens=6),
                                            b.generate(SAME_LEN[1], count_steps, max_new_tokens=6))
    stopped, other = run(main())
    solo = model.generate(SAME_LEN[0], stop_at_2, max_new_tokens=6)
    assert stopped.result == solo.result == 2
    assert stopped.tokens == solo.tokens.tolist() and len(stopped.tokens) == 2
    assert other.result == list(range(6))
    assert other.tokens == model.generate(SAME_LEN[1], max_new_tokens=6).tokens.tolist()
