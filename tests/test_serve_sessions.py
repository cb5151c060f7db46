"""Sessions as one job, through a real server: the same ``async def sweep(model)`` locally and remotely.

A session travels once (captured: source, the values and helpers it reads), runs on the server as submitted
code, sends every trace into the shared batches, keeps values on the server between traces and returns only
its result. Its budgets cover the whole session; a client that leaves stops it.
"""

import asyncio
import socket
import time

import pytest
import torch

from asyncinterp.models import tiny
from asyncinterp.serve import AsyncClient, Client, RemoteError, Server, wire
from serve_helpers import one_thread  # noqa: F401 - fixtures are found by name
from test_serve_http import Live

KEY = "session-key"
CLEAN, CORRUPT = "The cat sat on the", "A dog ran into a"      # 5 tokens each (exact=True: no padding)
LAYERS = [0, 1, 2]


async def sweep(model):
    """Causal tracing over three layers: a clean run, then one patched run per layer."""
    async def record(m):
        return [(await m.transformer.h[i].output).clone() for i in LAYERS]

    clean = await model.atrace(CLEAN, record)            # stays where the model is
    out = []
    for i in LAYERS:
        async def patch(m):
            h = await m.transformer.h[i].output
            h[:, -1] = clean[i][:, -1]
            return (await m.lm_head.output)[:, -1].softmax(-1)
        out.append(await model.atrace(CORRUPT, patch))
    return torch.stack(out)


async def generate_then_read(model):
    g = await model.agenerate(CLEAN, max_new_tokens=3)

    async def last(m):
        return (await m.lm_head.output)[:, -1].argmax(-1)
    return g.text, await model.atrace(CLEAN + g.text, last)


async def heavy_traces(model):
    """Each trace's code alone stays within the budget; the session's together do not."""
    async def spin(m):
        await m.transformer.h[0].output
        n = 0
        for k in range(1000000):
            n += k
        return n
    for _ in range(40):
        await model.atrace(CLEAN, spin)
    return "finished"


async def spin_between_traces(model):
    async def last(m):
        return (await m.lm_head.output)[:, -1].clone()
    await model.atrace(CLEAN, last)
    n = 0
    while True:          # the session's own code, between traces
        n += 1


async def forever(model):
    async def last(m):
        return (await m.lm_head.output)[:, -1].clone()
    while True:
        await model.atrace(CLEAN, last)


@pytest.fixture(scope="module")
def model():
    return tiny("gpt2", n_layer=3)


@pytest.fixture(scope="module")
def live(model):
    srv = Live(Server(model, api_keys=[KEY], allow_code=True, exact=True, max_batch=2, max_wait_ms=300,
                      timeout=20, code_budget=0.5))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(live):
    with Client(live.url, api_key=KEY, timeout=60) as c:
        yield c


def requests_run(live):
    return live.server.batcher.stats["requests"]


def test_a_patching_sweep_as_one_session_equals_the_local_run_and_shares_batches(model, live):
    local = asyncio.run(sweep(model))                      # the same function, on the local model
    assert local.shape == (3, 1, model.module.config.vocab_size)
    before = dict(live.server.batcher.stats)

    async def go():
        async with AsyncClient(live.url, api_key=KEY, timeout=60) as c:
            return await asyncio.gather(c.session(sweep), c.session(sweep))
    # both sessions are on their way for the whole sweep: each batch waits (max_wait_ms) for the other's trace
    with live.server.batcher.arrivals.expect(2):
        a, b = asyncio.run(asyncio.wait_for(go(), 120))
    assert torch.equal(a, local) and torch.equal(b, local)
    after = live.server.batcher.stats
    # 8 traces in 4 forward passes: each trace of one session shared its batch with the other session's
    assert after["requests"] - before["requests"] == 8 and after["batches"] - before["batches"] == 4


def test_generation_and_tokens_in_a_session(model, client):
    text, top = client.session(generate_then_read)
    want_text, want_top = asyncio.run(generate_then_read(model))
    assert text == want_text and torch.equal(top, want_top)


@pytest.mark.parametrize("fn", [heavy_traces, spin_between_traces])
def test_a_session_cannot_outlive_its_budget(live, client, fn):
    before = requests_run(live)
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match="compute budget") as info:
        client.session(fn)
    assert info.value.status == 504 and time.monotonic() - t0 < 15
    ran = requests_run(live) - before
    if fn is heavy_traces:
        assert 2 <= ran < 40        # no single trace broke the budget: the session's traces together did


def test_a_session_cannot_outlive_its_time_limit(client):
    t0 = time.monotonic()
    with pytest.raises(RemoteError) as info:
        client.session(forever, timeout=1.5)
    assert info.value.status == 504 and time.monotonic() - t0 < 10


def _raw_session(port, fn):
    from asyncinterp.serve.jobs.sessions import session_body
    body = session_body(fn)
    head = (f"POST /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/msgpack\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(head + body)
    return s


def _until_quiet(live, limit=10.0):
    """Wait until the server has run no new request for a second; return the count."""
    deadline = time.monotonic() + limit
    last = requests_run(live)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = requests_run(live)
        if now == last:
            return now
        last = now
    raise AssertionError("the server kept running requests")


def test_a_client_that_disconnects_stops_its_session(live):
    before = requests_run(live)
    s = _raw_session(live.port, forever)
    deadline = time.monotonic() + 10
    while requests_run(live) < before + 3:                 # the session is running traces
        assert time.monotonic() < deadline
        time.sleep(0.02)
    at_close = requests_run(live)
    s.close()
    assert _until_quiet(live) <= at_close + 2               # the trace in flight, at most one more: then it stopped


def test_a_cancelled_session_stops(live):
    async def go():
        async with AsyncClient(live.url, api_key=KEY, timeout=60) as c:
            task = asyncio.ensure_future(c.session(forever))
            before = requests_run(live)
            while requests_run(live) < before + 3:
                await asyncio.sleep(0.02)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return requests_run(live)
    at_cancel = asyncio.run(asyncio.wait_for(go(), 30))
    assert _until_quiet(live) <= at_cancel + 2


def _post_session(live, source, modules):
    """A session request written by hand (as a hostile client would), bypassing the client's capture."""
    import httpx
    from asyncinterp.client.capture import FORMAT
    description = {"format": FORMAT, "asyncinterp": "x", "python": "3.11", "tensors": [], "futures": [],
                   "functions": [{"name": "s", "source": source, "line": 1, "file": "hostile.py", "values": {},
                                  "functions": {}, "futures": {}, "modules": modules}]}
    body = wire.packb({"capture": description, "session": {"function": 0, "keywords": {}}})
    r = httpx.post(f"{live.url}/v1/sessions", content=body, timeout=30,
                   headers={"authorization": f"Bearer {KEY}", "content-type": "application/msgpack"})
    return r.status_code, wire.unpackb(r.content)["error"]["message"]


def test_session_code_is_checked_like_submitted_code(live):
    status, message = _post_session(live, "async def s(model):\n    return os.getcwd()\n", {"os": "os"})
    assert status == 400 and "module 'os' is not allowed" in message
    status, message = _post_session(live, "async def s(model):\n    return open('/etc/passwd').read()\n", {})
    assert status == 400 and "'open' is not available" in message
    status, message = _post_session(
        live, "async def s(model):\n    return await model.atrace('The cat sat on the', torch.zeros)\n",
        {"torch": "torch"})
    assert status == 422 and "must be an `async def` of the session's own code" in message
    status, message = _post_session(live, "async def s(model):\n    return model._server\n", {})
    assert status == 400 and "private" in message


@pytest.fixture(scope="module")
def isolated(model):
    """The CLI's default with --allow-code: process isolation; sessions run in the worker of submitted code."""
    from asyncinterp.serve.workers.supervisor import ProcessIsolation
    server = Server(model, api_keys=[KEY], allow_code=True, exact=True, max_wait_ms=5, timeout=20,
                    code_budget=0.5, isolation=ProcessIsolation(hang_timeout=2.0, memory_limit=512 << 20))
    server.batcher.start()
    srv = Live(server)
    yield srv
    srv.close()


def test_a_session_runs_in_the_confined_worker_with_process_isolation(model, isolated):
    with Client(isolated.url, api_key=KEY, timeout=60) as c:
        got = c.session(sweep)
        with pytest.raises(RemoteError, match="compute budget"):
            c.session(spin_between_traces)
        health = c.health()
    assert torch.equal(got, asyncio.run(sweep(model)))
    assert health["workers"]["code"]["restarts"] == 0
    assert health["workers"]["code"]["confined"] is (health["confinement"]["active"] is True)


async def saliency_sweep(model):
    """Gradients inside a session: the saliency of each layer's output for the top next token."""
    import torch

    async def saliency(m):
        hs = [await m.transformer.h[i].output for i in LAYERS]
        out = await m.lm_head.output
        return [g.norm() for g in torch.autograd.grad(out[:, -1].max(), hs)]
    return await model.atrace(CLEAN, saliency)


def test_gradients_in_a_session_in_the_confined_worker(model, isolated):
    with Client(isolated.url, api_key=KEY, timeout=60) as c:
        got = c.session(saliency_sweep)
    want = asyncio.run(saliency_sweep(model))
    assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, want))
