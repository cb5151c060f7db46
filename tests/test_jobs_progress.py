"""Every kind of kept job reports honest progress, and a job's event stream is pushed, not polled.

One in-process server (tiny GPT-2, a SQLite state directory) served by uvicorn in a thread, so that the
test can see what the runner reports (every progress it publishes) and how often an event stream reads
the store. Through the real HTTP API:

* a trace goes ``loading`` → ``forward`` (with its invokes); its status keeps the last progress;
* a generation goes ``loading`` → ``forward`` → ``generating`` with ``step`` of ``of`` at every token;
* a session counts its traces as they finish (``traces``, ``done``), up to all of them;
* the event stream of a session running in this process shows its progress as it happens (many
  ``status`` events, counts rising) while reading the store only when the job is claimed and when it ends
  (a poll every 0.25 s would read it a dozen times a second);
* a stream of a job that another replica runs (a shared PostgreSQL, nothing pushed here) reads the store
  and shows each of its changes.
"""

import json
import time

import httpx
import pytest
import torch

import asyncinterp as ai
from asyncinterp.models import tiny
from asyncinterp.serve import Server
from asyncinterp.serve.jobs.durable.service import Durable, DurableConfig
from jobs_helpers import long_session
from remote_helpers import Live
from serve_helpers import one_thread  # noqa: F401 - fixture found by name

KEY = "progress-key"


class Recorded(dict):
    """The runner's table of newest progress, recording every value it is given."""

    def __init__(self):
        super().__init__()
        self.log = []

    def __setitem__(self, jid, value):
        self.log.append((jid, value))
        super().__setitem__(jid, value)

    def of(self, jid):
        return [p for j, p in self.log if j == jid]


@pytest.fixture(scope="module")
def live(tmp_path_factory, one_thread):
    server = Server(tiny("gpt2"), api_keys=[KEY], allow_code=True, timeout=120, code_budget=60)
    server.durable = Durable(server, DurableConfig(state_dir=str(tmp_path_factory.mktemp("state"))))
    live = Live(server)
    server.durable.runner.changes.progress = Recorded()
    yield live
    live.close()


async def last(m):
    return (await m.transformer.h[1].output)[0][:, -1]


def test_trace_and_generation_report_their_phases(live):
    lm = ai.remote(live.url, api_key=KEY)
    recorded = live.server.durable.runner.changes.progress
    tr = lm.trace()
    tr.invoke("The Eiffel Tower is in", last)
    tr.invoke("The Colosseum is in", last)
    job = lm.submit(tr)
    both = job.result(timeout=60)
    assert torch.equal(both[0].result, lm.trace("The Eiffel Tower is in", last))
    assert [p["phase"] for p in recorded.of(job.id)] == ["loading", "forward"]
    assert job.status().progress == {"phase": "forward", "invokes": 2}        # kept with its outcome
    gen = lm.generate("Once upon a time", max_new_tokens=8, blocking=False)
    assert gen.result(timeout=60).text == lm.generate("Once upon a time", max_new_tokens=8).text
    seen = recorded.of(gen.id)
    assert [p["phase"] for p in seen[:2]] == ["loading", "forward"]
    assert [p["step"] for p in seen[2:]] == list(range(1, 9)) and {p["of"] for p in seen[2:]} == {8}
    assert gen.status().progress == {"phase": "generating", "step": 8, "of": 8, "invokes": 1}


def test_a_session_counts_its_traces_and_its_stream_is_pushed(live):
    lm = ai.remote(live.url, api_key=KEY)
    store = live.server.durable.store
    job = lm.session(long_session, blocking=False)
    reads = []
    get = store.get

    async def counted(job_id, owner):
        if job_id == job.id:
            reads.append(time.monotonic())
        return await get(job_id, owner)
    store.get = counted
    events, t0 = [], time.monotonic()
    try:
        with httpx.stream("GET", f"{live.url}/v1/jobs/{job.id}/events", headers={"authorization": f"Bearer {KEY}"},
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
    finally:
        store.get = get
    took = time.monotonic() - t0
    assert events[-1]["state"] == "succeeded"
    assert torch.equal(job.result(timeout=10), lm.session(long_session))
    counts = [e["progress"]["traces"] for e in events if e["state"] == "running" and "traces" in (e["progress"] or {})]
    assert len(counts) >= 10 and counts == sorted(counts) and len(set(counts)) == len(counts), counts
    assert events[-1]["progress"] == {"phase": "running", "traces": 400, "generations": 0, "done": 400}
    seen = live.server.durable.runner.changes.progress.of(job.id)
    assert seen[0] == {"phase": "loading"} and [p["traces"] for p in seen[1:]] == list(range(0, 401))
    # pushed: the stream read the store when the job was claimed and when it ended (and once per 5 s at most
    # besides), never every 0.25 s
    assert took > 1.0 and len(reads) <= 3 + took / 5, (len(reads), took)


def test_a_stream_reads_the_store_for_a_job_another_replica_runs(tmp_path, one_thread):
    # two replicas on one PostgreSQL: this server (which runs no jobs itself: --job-concurrency 0) streams a job
    # that "another replica" (a second store on the same database) claims, reports progress on and finishes.
    # Nothing is pushed here, so the stream polls the store, and shows each change.
    import asyncio
    import threading

    from asyncinterp.serve.jobs.durable.store import JobStore
    from pg_helpers import PostgresServer

    async def last_token(m):
        return (await m.transformer.h[0].output)[0][:, -1]

    with PostgresServer() as pg:
        server = Server(tiny("gpt2"), api_keys=[KEY], allow_code=True, timeout=60)
        server.durable = Durable(server, DurableConfig(database=pg.url, concurrency=0))
        live = Live(server)
        try:
            job = ai.remote(live.url, api_key=KEY).trace("The Eiffel Tower is in", last_token, blocking=False)
            events = []

            def read():
                with httpx.stream("GET", f"{live.url}/v1/jobs/{job.id}/events",
                                  headers={"authorization": f"Bearer {KEY}"}, timeout=60) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(json.loads(line[6:]))
            reader = threading.Thread(target=read, daemon=True)
            reader.start()

            async def other_replica():
                store = await JobStore.open(pg.url)
                while not events:
                    await asyncio.sleep(0.05)
                [row] = await store.claim("other-replica", 30.0)
                await asyncio.sleep(0.6)
                await store.set_progress(row["id"], "other-replica", {"phase": "forward", "invokes": 1})
                await asyncio.sleep(0.6)
                await store.finish(row["id"], "other-replica", "succeeded", result={"ok": True, "results": []})
                await store.close()
            asyncio.run(other_replica())
            reader.join(30)
        finally:
            live.close()
    assert [(e["state"], e["progress"]) for e in events] == [
        ("queued", None), ("running", None), ("running", {"phase": "forward", "invokes": 1}),
        ("succeeded", {"phase": "forward", "invokes": 1})]
