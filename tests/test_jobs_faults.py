"""Nothing lost, nothing answered twice: mixed kept jobs through three ``kill -9`` of a real server.

The issue asks for 1,000 jobs; on this suite's 2 shared cores the test runs ``JOBS`` (240 by default,
``ASYNCINTERP_FAULT_JOBS`` to change it: 1,000 take ~4x as long) mixed traces, generations and sessions
(12 distinct jobs, each submitted many times) into ``asyncinterp serve tiny-gpt2 --state-dir`` while a
submitter keeps sending. Three times, at a random moment while jobs run, the server is killed with
SIGKILL and restarted on the same state directory. Then:

* 0 lost: every job the server accepted (every 202, and every row of the store: the admin's list) ends,
  succeeded;
* 0 answered twice: no job's outcome is written twice (the runner's log of written outcomes, over all
  four lives of the server), and the jobs that were running at a kill record their restart;
* every result equals the same job run alone (blocking, one at a time, on the restarted server),
  bit-equal: ``--exact`` batching, one BLAS thread and ``MKL_CBWR=AUTO,STRICT`` (docs/serving.md).
"""

import collections
import json
import os
import random
import threading
import time

import httpx
import pytest
import torch

import asyncinterp as ai
from asyncinterp.client.wire import RemoteError
from jobs_helpers import JobServer, long_session

pytestmark = pytest.mark.slow

KEY, ADMIN = "fault-key", "fault-admin"
JOBS = int(os.environ.get("ASYNCINTERP_FAULT_JOBS", "240"))
PROMPTS = ["The Eiffel Tower is in", "Once upon a time there was", "A B C D", "The capital of Italy is the city of"]


async def layer0(m):
    return (await m.transformer.h[0].output)[0][:, -1]


async def layer1(m):
    return (await m.transformer.h[1].output)[0].sum(-1)


async def sweep(model):
    a = await model.atrace("The Eiffel Tower is in", layer1)
    b = await model.atrace("The Colosseum is in", layer1)
    return {"diff": a[..., :3] - b[..., :3], "a": a}


async def sweep2(model):
    g = await model.agenerate("Once upon a time", layer0, max_new_tokens=3)
    return [g.tokens, g.text]


TEMPLATES = [("trace", p, fn) for p in PROMPTS for fn in (layer0, layer1)] + [
    ("generate", "Once upon a time", None), ("generate", "The Eiffel Tower is in", layer0),
    ("session", sweep, None), ("session", sweep2, None)]


def submit(lm, template, blocking=False):
    kind, x, fn = template
    if kind == "trace":
        return lm.trace(x, fn, blocking=blocking)
    if kind == "generate":
        return lm.generate(x, *([fn] if fn else []), max_new_tokens=6, blocking=blocking)
    return lm.session(x, blocking=blocking)


def comparable(kind, value):
    if kind == "generate":
        return [value.tokens, value.text, value.result]
    return value


def equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    return a == b


def test_three_sigkills_lose_nothing_and_answer_once(tmp_path):
    log = tmp_path / "server.log"
    srv = JobServer("--api-key", KEY, "--admin-key", ADMIN, "--allow-code", "--isolation", "thread", "--exact",
                    "--deterministic", "--job-lease", "2", "--job-max-attempts", "10", "--job-concurrency", "8", "--quota-queued", "100000",
                    "--quota-running", "8", "--log-level", "info", "--timeout", "60",
                    state_dir=tmp_path / "state", log=log)
    srv.start()
    lm = ai.remote(srv.url, api_key=KEY, timeout=60)
    accepted = {}                 # id -> template index
    rng = random.Random(31)
    done = threading.Event()
    t0 = time.monotonic()

    def submitter():
        i = 0
        while i < JOBS:
            k = i % len(TEMPLATES)
            try:
                job = submit(lm, TEMPLATES[k])
            except (RemoteError, httpx.HTTPError, OSError):
                time.sleep(0.1)       # the server is down (killed): send this one again after its restart
                continue
            accepted[job.id] = k
            i += 1
        done.set()

    thread = threading.Thread(target=submitter, daemon=True)
    thread.start()
    admin = {"authorization": f"Bearer {ADMIN}"}
    try:
        for kill in range(3):
            time.sleep(rng.uniform(0.5, 3.0))
            deadline = time.monotonic() + 60
            while not httpx.get(f"{srv.url}/v1/jobs?state=running&limit=1", headers=admin, timeout=10).json()["data"]:
                assert time.monotonic() < deadline, "no job ever ran"
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 0.3))
            srv.kill()
            time.sleep(rng.uniform(0.1, 1.0))
            srv.start()
        assert done.wait(600), f"only {len(accepted)} of {JOBS} jobs were accepted"
        thread.join(10)
        handles = {jid: lm.job(jid) for jid in accepted}
        for h in handles.values():
            assert h.wait(timeout=300).state == "succeeded", h.status()
        elapsed = time.monotonic() - t0
        # the same jobs run alone, one at a time, blocking, on the server as it is now
        reference = [comparable(t[0], submit(lm, t, blocking=True)) for t in TEMPLATES]
        wrong = [jid for jid, k in accepted.items()
                 if not equal(comparable(TEMPLATES[k][0], handles[jid].result(timeout=60)), reference[k])]
        # every row the store holds (accepted with a lost 202 included) ended, succeeded
        rows, after = [], None
        while True:
            page = httpx.get(f"{srv.url}/v1/jobs?limit=100" + (f"&after={after}" if after else ""), headers=admin,
                             timeout=30).json()
            rows += page["data"]
            after = page["next"]
            if not after:
                break
    finally:
        srv.stop()
    assert not wrong, f"{len(wrong)} results differ from the same job run alone"
    assert {r["state"] for r in rows} == {"succeeded"}, collections.Counter(r["state"] for r in rows)
    assert set(accepted) <= {r["id"] for r in rows}
    assert len(rows) == len(set(r["id"] for r in rows)) >= JOBS
    written = collections.Counter()
    for line in log.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue       # a line cut by a kill
        if rec.get("msg") == "job ended" and rec.get("written"):
            written[rec["job"]] += 1
    twice = [jid for jid, n in written.items() if n > 1]
    assert not twice, f"answered twice: {twice[:5]}"
    restarted = [r for r in rows if r["restarts"]]
    assert restarted, "no job was running at any of the three kills"
    assert all(r["attempts"] == len(r["restarts"]) + 1 for r in rows)
    print(f"\n{len(accepted)} jobs accepted ({len(rows)} in the store), 3 SIGKILLs, {len(restarted)} jobs ran again "
          f"after a kill, 0 lost, 0 answered twice, all equal to solo runs; {elapsed:.1f} s "
          f"({srv.starts} server starts)")


def test_a_clean_stop_gives_running_jobs_back_at_once(tmp_path):
    # Ctrl-C (SIGINT) stops the server cleanly: its running job is given back to the queue, so the restarted
    # server runs it again at once, not after its lease (60 s here) runs out
    srv = JobServer("--api-key", KEY, "--allow-code", "--isolation", "thread", "--job-lease", "60", "--timeout", "120",
                    state_dir=tmp_path / "state")
    srv.start()
    try:
        lm = ai.remote(srv.url, api_key=KEY)
        job = lm.session(long_session, blocking=False)
        deadline = time.monotonic() + 60
        while job.status().state != "running":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        srv.stop()
        srv.start()
        st = job.wait(timeout=40)
        assert st.state == "succeeded" and st.attempts == 2 and len(st.restarts) == 1, st.info
        assert torch.equal(job.result(), lm.session(long_session))
    finally:
        srv.stop()
