"""Per-key quotas of kept jobs (serve/jobs/durable/quotas.py) on a real SQLite store: each refusal is a 429
naming its quota, with a Retry-After of when it frees; other keys are not affected. (The queued and
result-bytes quotas are also attacked through a real server in test_jobs_http.py.)"""

import asyncio

import pytest

from asyncinterp.serve.jobs.durable import quotas
from asyncinterp.serve.jobs.durable.store import JobStore, NewJob, owner_of
from asyncinterp.serve.jobs.errors import RequestFailed

A, B = owner_of("a"), owner_of("b")


def refusal(store, owner, q, now):
    try:
        asyncio.run(quotas.check(store, owner, q, now=now))
    except RequestFailed as fail:
        return fail
    return None


def test_quotas_refuse_with_429_naming_the_quota(tmp_path):
    async def setup():
        s = await JobStore.open(None, tmp_path)
        for i in range(2):          # two jobs of A ran 30 s each, finished at t=1000 and 1100
            jid = await s.submit(NewJob(A, "trace", b"x", 60.0), now=900.0 + 100 * i)
            await s.claim("w", 60.0, now=970.0 + 100 * i)
            await s.finish(jid, "w", "succeeded", result={"v": "x" * 5000}, now=1000.0 + 100 * i, ttl=500.0)
        await s.submit(NewJob(A, "trace", b"q", 60.0), now=1200.0)    # one queued
        return s
    store = asyncio.run(setup())
    try:
        fail = refusal(store, A, quotas.Quotas(queued=1), now=1200.0)
        assert fail.status == 429 and fail.error["quota"] == "queued" and "1 jobs queued, at most 1" in fail.error["message"]
        assert refusal(store, B, quotas.Quotas(queued=1), now=1200.0) is None          # per key
        fail = refusal(store, A, quotas.Quotas(queued=None, compute_seconds_per_hour=60), now=1200.0)
        assert fail.error["quota"] == "compute_seconds_per_hour" and "60.0 s in the last hour" in fail.error["message"]
        assert fail.headers["Retry-After"] == str(1000 + 3600 - 1200)        # when the oldest leaves the window
        assert refusal(store, A, quotas.Quotas(queued=None, compute_seconds_per_hour=61), now=1200.0) is None
        fail = refusal(store, A, quotas.Quotas(queued=None, result_bytes=10_000), now=1200.0)
        assert fail.error["quota"] == "result_bytes" and fail.headers["Retry-After"] == str(1500 - 1200)
        assert refusal(store, A, quotas.Quotas(queued=None, result_bytes=20_000), now=1200.0) is None
    finally:
        asyncio.run(store.close())


def test_running_quota_holds_a_keys_jobs_in_the_queue(tmp_path):
    async def go():
        s = await JobStore.open(None, tmp_path)
        for i in range(3):
            await s.submit(NewJob(A, "trace", b"a", 60.0), now=float(i))
        b = await s.submit(NewJob(B, "trace", b"b", 60.0), now=10.0)
        first = await s.claim("w", 60.0, limit=10, running_per_owner=2, now=20.0)
        again = await s.claim("w", 60.0, limit=10, running_per_owner=2, now=21.0)
        await s.close()
        return [r["owner"] for r in first], again, b
    owners, again, _ = asyncio.run(go())
    assert sorted(owners) == sorted([A, A, B]) and again == []        # A's third job waits
