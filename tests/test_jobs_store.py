"""The job store (serve/jobs/durable/store.py) on SQLite and on a throwaway PostgreSQL: migrations, ownership,
claims as compare-and-set (two servers, one winner), leases that expire and restarts that are recorded,
results written once (tensors bit-exact through JSON + safetensors), cancel, delete, expiry, quotas' counts."""

import asyncio
import time

import pytest
import sqlalchemy as sa
import torch

from asyncinterp.serve.jobs.durable import migrations
from asyncinterp.serve.jobs.durable.store import JobStore, NewJob, owner_of
from pg_helpers import PostgresServer

A, B, C = owner_of("key-a"), owner_of("key-b"), owner_of("key-c")


@pytest.fixture(scope="module")
def postgres():
    with PostgresServer() as pg:
        yield pg.url


def _drop_all(connection):
    meta = sa.MetaData()
    meta.reflect(connection)
    meta.drop_all(connection)


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    database = request.getfixturevalue("postgres") if request.param == "postgresql" else None
    if database:   # a fresh database per test: drop what an earlier test left
        async def clean():
            s = await JobStore.open(database, tmp_path)
            async with s.engine.begin() as conn:   # every table the migrations make (later revisions' too)
                await conn.run_sync(_drop_all)
            await s.close()
        asyncio.run(clean())
    yield lambda: JobStore.open(database, tmp_path, inline_bytes=1024)


def run(coro):
    return asyncio.run(coro)


def test_migrations_reach_head_and_are_idempotent(store):
    async def go():
        s = await store()
        await s.migrate()          # a second start finds the schema at head
        async with s.engine.connect() as conn:
            rev = await conn.run_sync(migrations.current)
            names = await conn.run_sync(lambda c: sa.inspect(c).get_table_names())
        await s.close()
        return rev, names
    rev, names = run(go())
    # one head (two helpers' revisions in a line, never two heads), and the store is at it
    assert rev == migrations.head() and rev >= "0002" and "asyncinterp_jobs" in names


def test_ownership_claim_finish_once(store):
    async def go():
        s = await store()
        big = bytes(range(256)) * 20       # over inline_bytes: a file beside the database
        jid = await s.submit(NewJob(A, "trace", big, 30.0))
        assert await s.get(jid, B) is None and (await s.get(jid, A))["state"] == "queued"
        assert (await s.get(jid, None))["owner"] == A          # the admin's view
        assert await s.request(await s.get(jid, A)) == big
        one, two = await asyncio.gather(s.claim("w1", 5.0), s.claim("w2", 5.0))
        assert len(one) + len(two) == 1, "two servers claimed one job"
        winner, loser = ("w1", "w2") if one else ("w2", "w1")
        result = {"results": [{"ok": True, "value": torch.randn(300, 7)}, (1, b"x", {3: None})]}
        assert not await s.finish(jid, loser, "succeeded", result={"x": 1})
        assert await s.finish(jid, winner, "succeeded", result=result, ttl=60)
        assert not await s.finish(jid, winner, "failed", error={"type": "X"})    # written once
        row = await s.get(jid, A)
        got = await s.result(row)
        await s.close()
        return row, got, result
    row, got, result = run(go())
    assert row["state"] == "succeeded" and row["attempts"] == 1 and row["result_path"]
    assert torch.equal(got["results"][0]["value"], result["results"][0]["value"])
    assert got["results"][1] == (1, b"x", {3: None})


def test_expired_lease_is_taken_over_and_recorded(store):
    async def go():
        s = await store()
        jid = await s.submit(NewJob(A, "generate", b"job", 30.0), now=100.0)
        assert [r["id"] for r in await s.claim("w1", 5.0, now=101.0)] == [jid]
        assert await s.claim("w2", 5.0, now=103.0) == []            # lease still held
        assert await s.heartbeat("w1", [jid], 5.0, now=104.0) == {jid: "ok"}
        assert await s.claim("w2", 5.0, now=108.0) == []            # renewed until 109
        taken = await s.claim("w2", 5.0, now=110.0)                  # w1 died: w2 takes over
        assert [r["id"] for r in taken] == [jid] and taken[0]["attempts"] == 2
        assert "lease expired" in taken[0]["restarts"][0]["why"]
        assert await s.heartbeat("w1", [jid], 5.0, now=110.5) == {jid: "lost"}
        assert not await s.finish(jid, "w1", "succeeded", result=1, now=111.0)
        assert await s.finish(jid, "w2", "succeeded", result=2, now=112.0)
        row = await s.get(jid, A)
        await s.close()
        return row, await s.result(row)
    row, value = run(go())
    assert value == 2 and row["attempts"] == 2 and len(row["restarts"]) == 1


def test_cancel_delete_expire_and_usage(store):
    async def go():
        s = await store()
        queued = await s.submit(NewJob(A, "trace", b"q", 30.0), now=1.0)
        running = await s.submit(NewJob(A, "trace", b"r", 30.0), now=2.0)
        assert await s.cancel(queued, B) is None                       # not B's: as if absent
        assert await s.cancel(queued, A) == "cancelled"
        [row] = await s.claim("w", 50.0, now=3.0)
        assert row["id"] == running                                     # the cancelled one never runs
        assert await s.cancel(running, A) == "running"
        assert await s.heartbeat("w", [running], 50.0, now=4.0) == {running: "cancel"}
        assert await s.finish(running, "w", "cancelled", now=5.0, ttl=10.0)
        done = await s.submit(NewJob(A, "trace", b"d", 30.0), now=6.0)
        await s.claim("w", 50.0, now=7.0)
        await s.finish(done, "w", "succeeded", result="x" * 100, now=9.0, ttl=100.0)
        usage = await s.usage(A, since=0.0, now=10.0)
        await s.submit(NewJob(C, "trace", b"c1", 30.0), now=9.5)
        await s.submit(NewJob(C, "trace", b"c2", 30.0), now=9.6)
        await s.claim("w", 50.0, now=9.7)         # c1 runs, c2 waits
        usage_c = await s.usage(C, since=0.0, now=10.0)
        page1 = await s.list(A, limit=2)
        page2 = await s.list(A, limit=2, before=(page1[-1]["created_at"], page1[-1]["id"]))
        listed_b = await s.list(B)
        assert not await s.delete(done, B)
        assert await s.delete(done, A) and await s.get(done, A) is None
        expired = await s.expire(now=20.0)        # the cancelled job's ttl ran out
        left = [r["id"] for r in await s.list(A)]
        await s.close()
        return usage, usage_c, page1, page2, listed_b, expired, left, (queued, running, done)
    usage, usage_c, page1, page2, listed_b, expired, left, (queued, running, done) = run(go())
    assert [r["id"] for r in page1] == [done, running] and [r["id"] for r in page2] == [queued]
    assert listed_b == [] and expired == 1 and left == [queued]
    assert usage["compute_seconds"] == pytest.approx(2.0 + 2.0) and usage["result_bytes"] > 100
    assert usage["queued"] == 0 and usage["oldest_finished"] == 5.0 and usage["next_expiry"] == 109.0
    assert usage_c["queued"] == 1 and usage_c["compute_seconds"] == pytest.approx(0.3)   # c1 running since 9.7


def test_a_job_whose_server_keeps_dying_fails_and_cancelled_ones_expire(store):
    async def go():
        s = await store()
        s.max_attempts, s.ttl = 2, 100.0
        jid = await s.submit(NewJob(A, "trace", b"poison", 30.0), now=0.0)
        assert len(await s.claim("w1", 1.0, now=1.0)) == 1          # attempt 1: its server dies
        assert len(await s.claim("w2", 1.0, now=3.0)) == 1          # attempt 2: dies too
        assert await s.claim("w3", 1.0, now=5.0) == []              # not a third time: it fails
        row = await s.get(jid, A)
        gone = await s.submit(NewJob(A, "trace", b"q", 30.0), now=6.0)
        await s.cancel(gone, A, now=7.0)
        cancelled = await s.get(gone, A)
        removed = await s.expire(now=200.0)
        await s.close()
        return row, cancelled, removed
    row, cancelled, removed = run(go())
    assert row["state"] == "failed" and row["error"]["type"] == "JobLost" and len(row["restarts"]) == 2
    assert cancelled["error"]["type"] == "RunCancelled" and cancelled["expires_at"] == 107.0
    assert removed == 2


def test_replicas_with_skewed_clocks_share_the_databases_clock(postgres, tmp_path):
    # two replicas on one PostgreSQL: the second one's clock runs 30 s ahead. Leases are on the database's
    # clock, so it neither takes over the first one's job (whose 10 s lease has not run out) nor keeps a lease
    # 30 s too long; times it writes are the database's.
    async def go():
        async def fresh():
            s = await JobStore.open(postgres, tmp_path)
            async with s.engine.begin() as conn:
                await conn.run_sync(_drop_all)
            await s.close()
        await fresh()
        a = await JobStore.open(postgres, tmp_path)
        b = await JobStore.open(postgres, tmp_path)
        b.clock = lambda: time.time() + 30.0          # a replica whose clock is wrong by 30 s
        await b.sync_clock()
        jid = await a.submit(NewJob(A, "trace", b"x", 30.0))
        [row] = await a.claim("replica-a", 10.0)
        taken_by_b = await b.claim("replica-b", 10.0)
        unsynced = JobStore(b.engine, None)          # the same replica without the database's clock
        unsynced.clock = b.clock
        taken_unsynced = await unsynced.claim("replica-c", 10.0)
        skew = (a.offset, b.offset)
        await a.close()
        await b.close()
        return row, taken_by_b, taken_unsynced, skew, jid
    row, taken_by_b, taken_unsynced, (off_a, off_b), jid = run(go())
    assert row["id"] == jid and taken_by_b == []
    assert abs(off_b - off_a + 30.0) < 1.0           # measured: 30 s behind its own clock
    assert [r["id"] for r in taken_unsynced] == [jid]   # what its own clock would have done: run it twice at once
