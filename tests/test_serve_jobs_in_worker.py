"""A supervised server passes a remote job on to the worker process that runs it, having read only its outline.

The worker reads, checks and tokenizes the job once; the server process compiles none of the submitted code;
a job the worker refuses is answered with that refusal's own status (never a stream that starts 200 and ends
in an error); a job with code that reaches the worker for registered interventions is refused there.
Everything through a real server (uvicorn, httpx) and real worker processes.
"""

import asyncio
import threading
import time

import anyio
import httpx
import pytest
import torch

import asyncinterp as ai
from asyncinterp.client import wire
from asyncinterp.client.job_form import dumps_job
from asyncinterp.client.protocol import versions
from asyncinterp.job import InvokeSpec, Job
from asyncinterp.serve import Server
from asyncinterp.serve.jobs import jobs_api
from asyncinterp.serve.sandbox import rebuild_sandbox
from asyncinterp.serve.scheduling.worker_failures import RemoteFailure
from asyncinterp.serve.workers.supervisor import ProcessIsolation
from remote_helpers import Live
from serve_helpers import model, one_thread  # noqa: F401 - fixtures are found by name

PROMPT = "The Eiffel Tower is in the city of"


async def last(m):
    return (await m.lm_head.output)[:, -1].clone()


async def escapes(m):
    return ().__class__.__bases__[0].__subclasses__()


def job_body(fn, stream=True) -> bytes:
    return wire.packb({**versions(), "job": dumps_job(Job((InvokeSpec(PROMPT, (fn,)),))), "stream": stream})


@pytest.fixture(scope="module")
def served(model):
    srv = Live(Server(model, allow_code=True, isolation=ProcessIsolation(), timeout=60))
    yield srv
    srv.close()


def test_the_server_process_compiles_none_of_the_submitted_code(served, model, monkeypatch):
    compiled = []
    real = rebuild_sandbox.Sandboxed.__call__
    monkeypatch.setattr(rebuild_sandbox.Sandboxed, "__call__",
                        lambda self, *a, **kw: compiled.append(a) or real(self, *a, **kw))
    remote = ai.remote(served.url)
    try:
        got = remote.trace(PROMPT, last)
        streamed = list(remote.stream(PROMPT, max_new_tokens=3))
    finally:
        remote.close()
    assert torch.allclose(got, model.trace(PROMPT, last), atol=1e-5)
    assert streamed and compiled == []    # (the worker process compiled and checked it)


@pytest.mark.parametrize("stream", [True, False])
def test_code_the_worker_refuses_is_a_plain_error_answer_with_its_status(served, stream):
    with httpx.Client(timeout=60) as http:
        r = http.post(f"{served.url}/v1/jobs", content=job_body(escapes, stream),
                      headers={"content-type": "application/msgpack"})
    assert r.status_code == 400, (r.status_code, r.content[:300])
    assert r.headers["content-type"].startswith("application/msgpack")   # an answer, not an event stream
    answer = wire.unpackb(r.content)
    assert answer["ok"] is False and answer["error"]["type"] == "SandboxRefused", answer
    assert "is not allowed in submitted code" in answer["error"]["message"], answer


def test_the_client_raises_the_refusal_and_the_server_goes_on(served, model):
    remote = ai.remote(served.url)
    try:
        with pytest.raises(Exception, match="is not allowed in submitted code"):
            remote.trace(PROMPT, escapes)
        assert torch.allclose(remote.trace(PROMPT, last), model.trace(PROMPT, last), atol=1e-5)
    finally:
        remote.close()


def test_a_job_that_is_not_one_is_refused_by_the_server_itself(served):
    body = wire.packb({**versions(), "job": wire.packb({"format": 2, "invokes": "three"}), "stream": True})
    with httpx.Client(timeout=60) as http:
        r = http.post(f"{served.url}/v1/jobs", content=body)
    assert r.status_code == 400 and "cannot be read" in wire.unpackb(r.content)["error"]["message"]


def test_submitted_code_on_a_server_that_takes_none_is_refused_before_any_worker(model):
    srv = Live(Server(model, allow_code=False, isolation=ProcessIsolation(), timeout=60))
    try:
        with httpx.Client(timeout=60) as http:
            r = http.post(f"{srv.url}/v1/jobs", content=job_body(last))
        assert r.status_code == 400, r.content[:300]
        assert wire.unpackb(r.content)["error"]["message"] == jobs_api.NO_CODE
        assert srv.server.batcher.stats["requests"] == 0     # no worker was sent it
    finally:
        srv.close()


def test_code_routed_to_the_worker_for_registered_interventions_is_refused_there(model):
    server = Server(model, allow_code=True, isolation=ProcessIsolation(), timeout=60)
    data = dumps_job(Job((InvokeSpec(PROMPT, (last,)),)))

    async def misrouted():
        return await server.batcher.job(data, code=False, timeout=60)   # as if the outline had missed its code
    try:
        with pytest.raises(RemoteFailure) as caught:
            asyncio.run(asyncio.wait_for(misrouted(), 120))
        assert caught.value.status == 500 and caught.value.wire_error["message"] == jobs_api.MISROUTED
    finally:
        server.batcher.close()


@pytest.mark.parametrize("stream", [True, False])
def test_a_batchs_end_sent_with_its_last_answer_ends_the_batch_on_the_server(served, model, stream):
    """A job's answer, when it is its batch's last, carries the batch's end in the same write: the server then
    holds no batch and no hard deadline for that worker (a deadline left armed would kill an idle worker)."""
    remote = ai.remote(served.url)
    try:
        for _ in range(3):
            got = remote.trace(PROMPT, last) if stream else None
            if not stream:
                r = httpx.post(f"{served.url}/v1/jobs", content=job_body(last, stream=False), timeout=60)
                assert r.status_code == 200
                got = wire.unpackb(r.content)["results"][0]["value"]
            assert torch.allclose(got, model.trace(PROMPT, last), atol=1e-5)
    finally:
        remote.close()
    pool = served.server.batcher.pools["code"]
    deadline = time.monotonic() + 5
    while (pool.worker.batch or pool.worker.batch_deadline is not None) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.worker.batch == [] and pool.worker.batch_deadline is None and pool.worker.jobs == {}
    assert pool.worker.proc.is_alive()


async def spin(m):
    await m.layers[0].output
    n = 0
    while n >= 0:      # until its budget (20 s here) or a cancel ends it
        n += 1
    return n


@pytest.fixture(scope="module")
def patient(model):
    srv = Live(Server(model, allow_code=True, isolation=ProcessIsolation(), timeout=60, code_budget=20.0))
    yield srv
    srv.close()


def test_a_lone_job_run_in_the_workers_loop_still_hears_cancels_and_new_requests(patient, model):
    """A job that reaches an idle worker runs in its event loop's main task (no task of its own); the pipe is
    heard meanwhile: a request sent while it runs is taken and answered after it, and the client's cancel
    ends it at its next tick, long before its 20 s budget."""
    remote, other = ai.remote(patient.url), ai.remote(patient.url)
    assert torch.allclose(remote.trace(PROMPT, last), model.trace(PROMPT, last), atol=1e-5)
    pid = patient.server.batcher.pools["code"].worker.proc.pid
    got = {}

    def second():
        time.sleep(0.3)       # sent while the spinning job runs
        got["read"] = other.trace(PROMPT, last)

    async def cancelled():
        with anyio.move_on_after(1.0) as scope:
            await remote.atrace(PROMPT, spin)
        return scope.cancelled_caught
    try:
        t = threading.Thread(target=second)
        t0 = time.monotonic()
        t.start()
        assert anyio.run(cancelled)
        t.join(30)
        assert time.monotonic() - t0 < 10      # not the spinning job's 20 s budget
        assert torch.allclose(got["read"], model.trace(PROMPT, last), atol=1e-5)
        assert torch.allclose(remote.trace(PROMPT, last), model.trace(PROMPT, last), atol=1e-5)
        assert patient.server.batcher.pools["code"].worker.proc.pid == pid     # the same worker throughout
    finally:
        remote.close()
        other.close()
