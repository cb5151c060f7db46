"""The lean path for posting jobs (``client/job_post.py``): taken only where it behaves as httpx would, and then
it answers as httpx does, replaces connections the server closed while they sat idle, is cancelled from
another thread, and keeps one connection per thread. Against a real server (uvicorn) on loopback."""

import re
import threading
import time

import anyio
import pytest
import torch

import asyncinterp as ai
from asyncinterp.client import job_post
from asyncinterp.serve import Server
from remote_helpers import Live
from serve_helpers import model, one_thread  # noqa: F401 - fixtures are found by name

PROMPT = "The Eiffel Tower is in the city of"


async def last(m):
    return (await m.lm_head.output)[:, -1].clone()


async def fails(m):
    await m.transformer.h[0].output
    raise ValueError("fails on purpose")


async def slow(m):
    await m.transformer.h[0].output
    time.sleep(3.0)      # (a registered intervention: trusted code may block)
    return 0


@pytest.fixture(scope="module")
def live(model):
    server = Server(model, allow_code=True, isolation="thread", timeout=60)
    server.intervention("slow")(slow)
    srv = Live(server)
    yield srv
    srv.close()


def test_plain_http_takes_the_lean_path_and_answers_as_httpx_does(live, model):
    lean, plain = ai.remote(live.url), ai.remote(live.url, headers={"x-through": "httpx"})
    try:
        assert lean.poster is not None and plain.poster is None     # httpx options: httpx carries the jobs
        expected = model.trace(PROMPT, last)
        assert torch.equal(lean.trace(PROMPT, last), plain.trace(PROMPT, last))
        assert torch.allclose(lean.trace(PROMPT, last), expected, atol=1e-5)
        errors = []
        for remote in (lean, plain):            # a failure on the server reads the same either way
            with pytest.raises(ValueError, match="fails on purpose") as caught:
                remote.trace(PROMPT, fails)
            errors.append(re.sub(r"#[0-9a-f]{16}", "#job", str(caught.value)))   # (each job's own file name)
        assert errors[0] == errors[1]
    finally:
        lean.close()
        plain.close()


def test_only_plain_http_without_a_proxy_takes_the_lean_path(monkeypatch):
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert job_post.usable("http://127.0.0.1:8000", {})
    assert not job_post.usable("https://example.org", {})
    assert not job_post.usable("http://127.0.0.1:8000", {"verify": False})
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    assert not job_post.usable("http://10.1.2.3:8000", {})          # httpx would go through the proxy
    monkeypatch.setenv("NO_PROXY", "10.1.2.3")
    assert job_post.usable("http://10.1.2.3:8000", {})


def test_a_connection_the_server_closed_while_idle_is_replaced(live, model, monkeypatch):
    expected = model.trace(PROMPT, last)
    checked, unchecked = ai.remote(live.url), ai.remote(live.url)
    try:
        for remote in (checked, unchecked):
            remote.trace(PROMPT, last)
        first = (checked.poster.local.conn, unchecked.poster.local.conn)
        time.sleep(7.0)             # past uvicorn's keep-alive timeout (5 s): it closes both connections
        assert torch.allclose(checked.trace(PROMPT, last), expected, atol=1e-5)     # noticed before reuse
        monkeypatch.setattr(job_post, "_idle_and_open", lambda sock: True)       # not noticed: sent, refused
        assert torch.allclose(unchecked.trace(PROMPT, last), expected, atol=1e-5)  # ... and sent again
        assert checked.poster.local.conn is not first[0] and unchecked.poster.local.conn is not first[1]
    finally:
        checked.close()
        unchecked.close()


def test_each_thread_has_its_own_connection(live, model):
    expected = model.trace(PROMPT, last)
    remote = ai.remote(live.url)
    results, conns = [], []

    def work():
        for _ in range(3):
            results.append(torch.allclose(remote.trace(PROMPT, last), expected, atol=1e-5))
        conns.append(remote.poster.local.conn)
    try:
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == [True] * 12 and len({id(c) for c in conns}) == 4
    finally:
        remote.close()
    assert not remote.poster.open       # closing the model closes every thread's connection


def test_cancelling_a_lean_request_ends_it_at_once_and_the_model_goes_on(live, model):
    remote = ai.remote(live.url)

    async def cancelled():
        with anyio.move_on_after(0.5) as scope:
            await remote.atrace(PROMPT, remote.registered("slow"))
        return scope.cancelled_caught
    try:
        t0 = time.monotonic()
        assert anyio.run(cancelled)
        assert time.monotonic() - t0 < 2.0      # not the 3 s the intervention takes
        assert torch.allclose(remote.trace(PROMPT, last), model.trace(PROMPT, last), atol=1e-5)
    finally:
        remote.close()


def test_the_end_of_an_answer_is_read_when_the_connection_is_next_used(live, model):
    expected = model.trace(PROMPT, last)
    remote = ai.remote(live.url)
    try:
        assert torch.allclose(remote.trace(PROMPT, last), expected, atol=1e-5)
        conn = remote.poster.local.conn
        assert remote.poster.local.left is not None      # the answer's last bytes: read with the next request
        for _ in range(3):
            assert torch.allclose(remote.trace(PROMPT, last), expected, atol=1e-5)
        assert remote.poster.local.conn is conn           # drained and reused, never reopened
    finally:
        remote.close()


def test_a_request_head_and_body_go_out_in_one_write():
    """``http.client`` writes a request's head and body apart (two system calls, and the server sees the head
    first); the lean path's connection writes them together."""
    import socket as _socket
    import threading as _threading
    from asyncinterp.client.job_post import OneSegmentConnection
    srv = _socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    received = []

    def serve():
        c, _ = srv.accept()
        data = b""
        while not data.endswith(b"y" * 10):
            data += c.recv(65536)
        received.append(data)
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        c.close()
    t = _threading.Thread(target=serve)
    t.start()
    conn = OneSegmentConnection("127.0.0.1", srv.getsockname()[1], timeout=5)
    conn.connect()
    writes = []
    real = conn.sock

    class Counting:
        def sendall(self, data):
            writes.append(bytes(data))
            return real.sendall(data)

        def __getattr__(self, name):
            return getattr(real, name)
    conn.sock = Counting()
    body = b"x" * 3000 + b"y" * 10
    conn.request("POST", "/v1/jobs", body=body, headers={"content-length": str(len(body))})
    conn.sock = real
    assert conn.getresponse().read() == b"ok"
    t.join(5)
    srv.close()
    assert len(writes) == 1 and writes[0].startswith(b"POST /v1/jobs HTTP/1.1\r\n") and writes[0].endswith(body)
    assert received[0] == writes[0]
