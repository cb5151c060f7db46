"""Kept jobs through a real server (``asyncinterp serve tiny-gpt2 --state-dir``), as a user drives them:
``blocking=False`` traces, generations and sessions whose results equal the blocking calls; status with
progress; a failure raised as locally; cancel (queued never runs, running stops); reattach from another
process; quotas answered 429 with Retry-After; and ownership attacked with another key (docs/jobs.md)."""

import json
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
import torch

import asyncinterp as ai
from asyncinterp.client import wire
from jobs_helpers import ROOT, JobServer

A, B, C, D, ADMIN = "key-a", "key-b", "key-c", "key-d", "key-admin"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = JobServer("--api-key", A, "--api-key", B, "--api-key", C, "--api-key", D, "--admin-key", ADMIN,
                    "--allow-code", "--isolation", "thread", "--job-lease", "3", "--job-concurrency", "4",
                    "--quota-queued", "3", "--quota-running", "1", "--quota-result-bytes", "300000",
                    "--code-budget", "30", "--timeout", "60",
                    state_dir=tmp_path_factory.mktemp("state"))
    srv.start()
    yield srv
    srv.stop()


def lm(server, key=A):
    return ai.remote(server.url, api_key=key)


async def last(m):
    return (await m.transformer.h[1].output)[0][:, -1]


async def sweep(model):
    a = await model.atrace("The Eiffel Tower is in", last)
    b = await model.atrace("The Colosseum is in", last)
    return a - b


async def bad(m):
    raise ValueError("a bad intervention")


async def spin(m):      # runs until cancelled (or its budget): serve_helpers.SPIN
    await m.transformer.h[0].output
    n = 0
    while True:
        n += 1


def test_trace_generation_session_equal_blocking(server):
    model = lm(server)
    t = model.trace("The Eiffel Tower is in", last, blocking=False)
    g = model.generate("Once upon a time", max_new_tokens=12, blocking=False)
    s = model.session(sweep, blocking=False)
    assert t.id.startswith("job_") and len(t.id) > 30 and t.status().state in ("queued", "running", "succeeded")
    assert torch.equal(t.result(timeout=60), model.trace("The Eiffel Tower is in", last))
    gen = g.result(timeout=60)
    ref = model.generate("Once upon a time", max_new_tokens=12)
    assert torch.equal(gen.tokens, ref.tokens) and gen.text == ref.text
    st = g.status()
    assert st.state == "succeeded" and st.attempts == 1 and st.restarts == []
    assert torch.equal(s.result(timeout=60), model.session(sweep))


def test_submitted_trace_of_several_invokes_and_await(server):
    import anyio
    model = lm(server)
    tr = model.trace()
    one = tr.invoke("The Eiffel Tower is in", last)
    two = tr.invoke("The Colosseum is in", last)
    job = model.submit(tr)

    async def main():
        return await job
    invs = anyio.run(main)
    assert invs[0] is one and invs[1] is two
    with model.trace() as ref:
        r1 = ref.invoke("The Eiffel Tower is in", last)
        r2 = ref.invoke("The Colosseum is in", last)
    assert torch.equal(one.result, r1.result) and torch.equal(two.result, r2.result)


def test_failure_is_raised_as_locally_and_reattach_from_another_process(server):
    model = lm(server)
    job = model.trace("x", bad, blocking=False)
    with pytest.raises(ValueError, match="a bad intervention"):
        job.result(timeout=60)
    st = job.status()
    assert st.state == "failed" and isinstance(st.error, ValueError)
    ok = model.trace("The Eiffel Tower is in", last, blocking=False)
    script = textwrap.dedent(f"""
        import asyncinterp as ai, torch, sys
        lm = ai.remote({server.url!r}, api_key={A!r})
        value = lm.job({ok.id!r}).result(timeout=60)
        try:
            lm.job({job.id!r}).result(timeout=60)
        except ValueError as exc:
            print("raised ValueError", str(exc).splitlines()[0])
        torch.save(value, sys.argv[1])
    """)
    out = ROOT / "tests" / ".reattached.pt"
    try:
        proc = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, timeout=120,
                              env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "raised ValueError ValueError: a bad intervention" in proc.stdout
        assert torch.equal(torch.load(out), model.trace("The Eiffel Tower is in", last))
    finally:
        out.unlink(missing_ok=True)


def test_cancel_running_and_queued_and_progress_stream(server):
    model = lm(server, C)       # --quota-running 1: C's second job waits in the queue behind the first
    running = model.trace("x", spin, blocking=False)
    queued = model.trace("The Eiffel Tower is in", last, blocking=False)
    deadline = time.monotonic() + 30
    while running.status().state != "running":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert queued.status().state == "queued"
    assert queued.cancel() == "cancelled"
    t0 = time.monotonic()
    assert running.cancel() in ("running", "cancelled")
    st = running.wait(timeout=30)
    assert st.state == "cancelled" and time.monotonic() - t0 < 10      # stopped at its next hook point
    with pytest.raises(ai.RunCancelled):
        running.result()
    time.sleep(1.0)
    assert queued.status().state == "cancelled" and queued.status().info["started_at"] is None   # never ran
    # the event stream of a generation: status events up to its end, progress on the way
    job = lm(server).generate("Once upon a time", max_new_tokens=40, blocking=False)
    events = []
    with httpx.stream("GET", f"{server.url}/v1/jobs/{job.id}/events", headers={"authorization": f"Bearer {A}"},
                      timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert events[-1]["state"] == "succeeded" and events[-1]["id"] == job.id
    assert [e["state"] for e in events][0] in ("queued", "running")


def test_quotas_answer_429_naming_the_quota(server):
    model = lm(server, D)
    held = model.trace("x", spin, blocking=False)           # runs (quota running 1) ...
    queued = [model.trace("The Eiffel Tower is in", last, blocking=False) for _ in range(3)]   # ... 3 wait
    r = httpx.post(f"{server.url}/v1/jobs", headers={"authorization": f"Bearer {D}", "content-type": "application/msgpack"},
                   content=wire.packb({**ai.remote(server.url).versions, "wait": False,
                                       "job": _job_bytes(server)}), timeout=30)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    error = wire.unpackb(r.content)["error"]
    assert error["type"] == "QuotaExceeded" and error["quota"] == "queued" and "queued" in error["message"]
    with pytest.raises(Exception, match="quota queued exceeded"):
        model.trace("The Eiffel Tower is in", last, blocking=False)
    for job in (*reversed(queued), held):   # the queued ones first: none may start (and finish) once held ends
        job.cancel()
    for job in (held, *queued):
        assert job.wait(timeout=30).state == "cancelled"
    # stored result bytes: a 100k-float result (400 kB) is kept; the next job is refused until it is deleted
    async def big(m):
        await m.transformer.h[0].output
        return torch.ones(100_000)
    first = model.trace("x", big, blocking=False)
    assert torch.equal(first.result(timeout=60), torch.ones(100_000))
    with pytest.raises(Exception, match="quota result_bytes exceeded") as info:
        model.trace("x", last, blocking=False)
    assert info.value.status == 429
    first.delete()
    again = model.trace("The Eiffel Tower is in", last, blocking=False)
    assert again.result(timeout=60).shape[-1] > 0


def _job_bytes(server):
    from asyncinterp.client.job_form import dumps_job
    tr = ai.remote(server.url, api_key=D, check_modules=False).trace()
    tr.invoke("The Eiffel Tower is in", last)
    return dumps_job(tr.job)


def test_ownership_attacked_with_another_key(server):
    mine = lm(server, A).trace("The Eiffel Tower is in", last, blocking=False)
    mine.wait(timeout=60)
    never = "job_" + "x" * 32

    def as_(key, method, path):
        return httpx.request(method, f"{server.url}{path}", headers={"authorization": f"Bearer {key}"}, timeout=30)

    for path, method in ((f"/v1/jobs/{mine.id}", "GET"), (f"/v1/jobs/{mine.id}/result", "GET"),
                         (f"/v1/jobs/{mine.id}/events", "GET"), (f"/v1/jobs/{mine.id}", "DELETE")):
        theirs, absent = as_(B, method, path), as_(B, method, path.replace(mine.id, never))
        assert theirs.status_code == absent.status_code == 404, (path, method, theirs.text)
        strip = lambda r: r.content.replace(mine.id.encode(), b"ID").replace(never.encode(), b"ID")  # noqa: E731
        assert strip(theirs) == strip(absent)                  # nothing tells an existing job from a made-up one
    assert mine.id not in [j["id"] for j in as_(B, "GET", "/v1/jobs").json()["data"]]
    with pytest.raises(Exception, match="no job"):
        lm(server, B).job(mine.id)
    assert as_("not-a-key", "GET", f"/v1/jobs/{mine.id}").status_code == 401
    assert httpx.get(f"{server.url}/v1/jobs/{mine.id}", timeout=30).status_code == 401
    # still the owner's, untouched
    assert mine.status().state == "succeeded" and mine.result().shape[-1] > 0
    # the admin key lists every key's jobs (and their status), but reads no one's result
    listed = [j["id"] for j in as_(ADMIN, "GET", "/v1/jobs?limit=100").json()["data"]]
    assert mine.id in listed
    assert as_(ADMIN, "GET", f"/v1/jobs/{mine.id}").json()["state"] == "succeeded"
    assert as_(ADMIN, "GET", f"/v1/jobs/{mine.id}/result").status_code == 404


def test_list_is_paged_and_results_can_be_deleted(server):
    model = lm(server, B)
    jobs = [model.trace("The Eiffel Tower is in", last, blocking=False) for _ in range(3)]
    for j in jobs:
        j.wait(timeout=60)
    h = {"authorization": f"Bearer {B}"}
    page = httpx.get(f"{server.url}/v1/jobs?limit=2", headers=h, timeout=30).json()
    rest = httpx.get(f"{server.url}/v1/jobs?limit=2&after={page['next']}", headers=h, timeout=30).json()
    ids = [j["id"] for j in page["data"] + rest["data"]]
    assert ids[:3] == [j.id for j in reversed(jobs)]
    jobs[0].delete()
    with pytest.raises(Exception, match="no job"):
        jobs[0].status()


def test_jobs_command_line(server):
    job = lm(server, B).trace("The Eiffel Tower is in", last, blocking=False)

    def cli(*args, key=B):
        out = subprocess.run([sys.executable, "-m", "asyncinterp.cli", "jobs", *args, "--api-key", key],
                             capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(ROOT / "src"),
                                                                               "PATH": "/usr/bin:/bin"})
        return out.returncode, out.stdout, out.stderr

    code, out, _ = cli("result", server.url, job.id, "--wait", "60")
    assert code == 0 and "tensor(" in out
    code, out, _ = cli("status", server.url, job.id)
    assert code == 0 and json.loads(out)["state"] == "succeeded"
    code, out, _ = cli("list", server.url)
    assert code == 0 and job.id in out and "succeeded" in out
    code, _, err = cli("status", server.url, job.id, key=A)           # another key: no such job
    assert code == 1 and "HTTP 404" in err and "NotFound" in err
    code, out, _ = cli("status", server.url, job.id, "--follow")
    assert code == 0 and json.loads(out.splitlines()[-1])["state"] == "succeeded"
    code, out, _ = cli("cancel", server.url, job.id)
    assert code == 0 and out.strip() == "deleted"
    code, _, err = cli("result", server.url, job.id)
    assert code == 1 and "HTTP 404" in err
