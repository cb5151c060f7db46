"""Per-request time budgets against a real server (uvicorn on 127.0.0.1).

Submitted code gets its own compute budget (CPU time while its own tasks
run) and is stopped at the tick where it runs out, while the forward goes on
for its batch-mates; the time it held the worker is credited to the other
requests' deadlines, so a spinner does not make its innocent batch-mates
time out. Grouping is deterministic: the grouped tests' server closes a batch
when all of its ``GROUP`` requests (same token length, ``exact=True``) have
arrived (``max_batch=GROUP``, a long ``max_wait_ms``), however slow the
machine is.
"""

import asyncio
import random
import statistics
import time

import httpx
import pytest
import torch

from asyncinterp.serve import AsyncClient, RemoteError
from test_serve_http import KEY, PROMPTS, Live, last, make_server
from serve_helpers import SPIN, model, one_thread  # noqa: F401 - fixtures are found by name

GROUP = 5                 # requests per batch in the grouped tests
BUDGET = 1.5              # the grouped server's code_budget (CPU seconds)
SAME = PROMPTS[:8]        # all 5 tokens long: one batch key with exact=True

# slow but legitimate: busy Python work (~0.1 s of CPU) well under its own budget, then a result
LEGIT = """
async def f(m, n=400000):
    h = await m.transformer.h[0].output
    s = 0
    for i in range(n):
        s += i
    return (await m.lm_head.output)[:, -1].clone() + (s % 7)
"""


async def legit_local(m, n=400000):
    await m.transformer.h[0].output
    return (await m.lm_head.output)[:, -1].clone() + (sum(range(n)) % 7)


# a spinner spread over many hook firings: every generation step spins a bounded while, well under the
# budget on its own (~0.2-0.5 s CPU on the machines we know; a 4x faster one still passes 1.5 s in 24 steps)
STEP_SPIN = """
async def f(m, n=2000000):
    k = 0
    async for step in m.steps():
        await m.transformer.h[0].output
        i = 0
        while i < n:
            i += 1
        k += 1
    return k
"""

CRASH = """
async def f(m):
    h = await m.transformer.h[1].output
    raise ValueError("crashing on purpose")
"""


@pytest.fixture(scope="module")
def grouped(model):
    srv = Live(make_server(model, allow_code=True, exact=True, max_batch=GROUP, max_wait_ms=5000, timeout=20,
                           code_budget=BUDGET, max_queue=256))
    yield srv
    srv.close()


def _healthy(live):
    assert httpx.get(f"{live.url}/v1/health", timeout=10).json()["status"] == "ok"


def _is_budget_cut(err, budget):
    assert isinstance(err, RemoteError), err
    assert err.status == 504 and err.kind == "timeout" and err.type == "SandboxTimeout", err
    assert f"compute budget of {budget:g} s" in err.message, err.message
    return True


def test_spinner_is_cut_at_its_budget_and_a_slow_batch_mate_succeeds(grouped, model):
    """One batch: a busy-loop spinner, a slow legitimate submitted request, three registered innocents.

    The legitimate request and the innocents ask for a 1.2 s limit: less than the spinner's 1.5 s budget,
    so they can only succeed if the spinner's time does not count against their deadlines.
    """
    before = dict(grouped.server.batcher.stats)

    async def go():
        async with AsyncClient(grouped.url, api_key=KEY, timeout=60) as c:
            t0 = time.monotonic()

            async def timed(aw):
                try:
                    return await aw, time.monotonic() - t0
                except RemoteError as exc:
                    return exc, time.monotonic() - t0
            return await asyncio.gather(
                timed(c.trace(SAME[0], SPIN)),
                timed(c.trace(SAME[1], LEGIT, timeout=1.2)),
                *[timed(c.trace(p, "last", timeout=1.2)) for p in SAME[2:5]])

    with grouped.server.batcher.arrivals.expect(GROUP):   # the group's requests are on their way together

        (spin, t_spin), (legit, t_legit), *innocent = asyncio.run(go())
    stats = grouped.server.batcher.stats
    assert stats["batches"] - before["batches"] == 1 and stats["requests"] - before["requests"] == GROUP
    assert _is_budget_cut(spin, BUDGET)
    assert any("while True" in line for line in spin.remote_traceback), spin.remote_traceback   # where it was cut
    assert isinstance(legit, torch.Tensor), legit
    assert torch.equal(legit, model.trace(SAME[1], legit_local))                          # bit-equal to solo
    for p, (r, _) in zip(SAME[2:5], innocent):
        assert isinstance(r, torch.Tensor), (p, r)
        assert torch.equal(r, model.trace(p, last)), p                                     # bit-equal to solo
    # they waited for the spinner (at least its budget of CPU time) and still made their 1.2 s limits
    assert min(t_legit, *(t for _, t in innocent)) >= BUDGET * 0.9
    _healthy(grouped)


def test_many_short_spins_in_a_generation_add_up_to_the_budget(grouped, model):
    """Each generation step spins briefly; together they exceed the budget: cut in a later step."""
    n_new = 24

    async def go():
        async with AsyncClient(grouped.url, api_key=KEY, timeout=60) as c:
            bad = c.generate(SAME[0], STEP_SPIN, max_new_tokens=n_new)
            good = [c.generate(p, max_new_tokens=n_new, timeout=2.0) for p in SAME[1:GROUP]]
            return await asyncio.gather(bad, *good, return_exceptions=True)

    with grouped.server.batcher.arrivals.expect(GROUP):   # the group's requests are on their way together

        bad, *good = asyncio.run(go())
    assert _is_budget_cut(bad, BUDGET)
    assert any("while i < n" in line or "i += 1" in line for line in bad.remote_traceback), bad.remote_traceback
    for p, r in zip(SAME[1:GROUP], good):
        assert not isinstance(r, BaseException), (p, r)
        assert r.tokens == model.generate(p, max_new_tokens=n_new).tokens.tolist(), p  # bit-equal to solo
    _healthy(grouped)


def test_budget_counts_only_the_codes_own_time(grouped):
    """A request whose steps each spin a little, well under the budget in all, is not cut, however long
    the generation takes."""
    async def go():
        async with AsyncClient(grouped.url, api_key=KEY, timeout=60) as c:
            mine = c.generate(SAME[0], STEP_SPIN, params={"n": 20000}, max_new_tokens=8)
            rest = [c.generate(p, max_new_tokens=8) for p in SAME[1:GROUP]]
            return await asyncio.gather(mine, *rest)
    with grouped.server.batcher.arrivals.expect(GROUP):   # the group's requests are on their way together
        mine, *_ = asyncio.run(go())
    assert mine.result == 8
    _healthy(grouped)


# --------------------------------------------------------------------------- hostile load
def _p50(xs):
    return statistics.median(xs)


def test_hostile_load_loses_no_innocent_request(model):
    """Concurrency 32, 200 requests: 10% spinners (cut at their budget), 10% crashing, 80% innocent.

    No innocent request is lost or fails, and each is bit-equal to its solo run; the innocent p50 latency
    is measured with and without the bad requests (printed; see benchmarks/hostile_load.py for figures).
    """
    budget = 0.05
    srv = Live(make_server(model, allow_code=True, exact=True, max_batch=32, max_wait_ms=3, timeout=20,
                           code_budget=budget, max_queue=1024))
    try:
        refs = {p: model.trace(p, last) for p in PROMPTS}
        rng = random.Random(0)
        kinds = ["spin"] * 20 + ["crash"] * 20 + ["ok"] * 160
        rng.shuffle(kinds)
        jobs = [(i, rng.choice(PROMPTS), k) for i, k in enumerate(kinds)]

        async def run(jobs):
            sem = asyncio.Semaphore(32)
            async with AsyncClient(srv.url, api_key=KEY, timeout=60) as c:
                async def one(i, p, kind):
                    async with sem:
                        t0 = time.perf_counter()
                        try:
                            if kind == "spin":
                                r = await c.trace(p, SPIN)
                            elif kind == "crash":
                                r = await c.trace(p, CRASH)
                            else:
                                r = await c.trace(p, "last", timeout=5.0)
                        except RemoteError as exc:
                            r = exc
                        return i, r, time.perf_counter() - t0
                t0 = time.perf_counter()
                out = await asyncio.wait_for(asyncio.gather(*[one(*j) for j in jobs]), 50)
                return out, time.perf_counter() - t0

        innocent_jobs = [j for j in jobs if j[2] == "ok"]
        asyncio.run(run(innocent_jobs[:32]))                     # warm up
        clean, t_clean = asyncio.run(run(innocent_jobs))
        hostile, t_hostile = asyncio.run(run(jobs))
        assert len(hostile) == len(jobs) and len(clean) == len(innocent_jobs)   # none lost
        by_id = {i: (p, k) for i, p, k in jobs}
        for results in (clean, hostile):
            for i, r, _ in results:
                p, kind = by_id[i]
                if kind == "spin":
                    assert _is_budget_cut(r, budget)
                elif kind == "crash":
                    assert isinstance(r, RemoteError) and r.status == 422 and r.type == "ValueError", r
                else:
                    assert isinstance(r, torch.Tensor) and torch.equal(r, refs[p]), (i, p, r)
        p50_clean = _p50([t for _, _, t in clean])
        p50_hostile = _p50([t for i, _, t in hostile if by_id[i][1] == "ok"])
        print(f"\ninnocent p50: {1000 * p50_clean:.0f} ms without bad requests ({len(clean) / t_clean:.0f} req/s), "
              f"{1000 * p50_hostile:.0f} ms with 10% spinners (budget {budget} s) and 10% crashers "
              f"({len(hostile) / t_hostile:.0f} req/s); ratio {p50_hostile / p50_clean:.2f}")
        _healthy(srv)
    finally:
        srv.close()
