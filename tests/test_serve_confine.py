"""The worker that runs submitted code is confined by seccomp: escaped code reaches no file, network or process.

"Escaped" is played by a registered intervention: trusted server code is plain Python with the whole
standard library, and on a server whose one worker also runs submitted code
(``ProcessIsolation(code_worker=False)``) it runs in that confined worker exactly as code that got out of the
Python sandbox would. It tries to open sockets, write, create and delete files, start processes and signal the
server; the worker then goes on serving normal requests.
"""

import asyncio
import os
import socket
import subprocess
import sys

import httpx
import pytest
import torch

from asyncinterp.serve import AsyncClient, Server, confine
from asyncinterp.serve.workers.supervisor import ProcessIsolation
from serve_helpers import model, one_thread  # noqa: F401 - fixtures are found by name
from test_serve_http import Live

KEY = "confine-key"
PROMPTS = ["The cat sat on the", "A dog ran into a"]
LAST = "async def f(m):\n    return (await m.lm_head.output)[:, -1].clone()\n"

pytestmark = pytest.mark.skipif(confine.probe() is not None, reason=f"no seccomp here: {confine.probe()}")


def _attempt(fn):
    try:
        got = fn()
    except OSError as exc:
        return f"refused:{exc.errno}"
    return f"ALLOWED:{got!r}"[:200]


async def escape(m, directory: str):
    """What code that escaped the Python sandbox would try, run in the worker as plain Python."""
    await m.transformer.h[0].output
    marker = os.path.join(directory, "made-by-a-process")
    tries = {
        "tcp socket": lambda: socket.create_connection(("127.0.0.1", 9), timeout=1),
        "udp socket": lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM),
        "ipv6 socket": lambda: socket.socket(socket.AF_INET6),
        "unix socket": lambda: socket.socket(socket.AF_UNIX),
        "write a file": lambda: open(os.path.join(directory, "written"), "w").write("x"),
        "append to a file": lambda: open(os.path.join(directory, "existing"), "a").write("x"),
        "open read-write": lambda: open(os.path.join(directory, "existing"), "r+"),
        "delete a file": lambda: os.unlink(os.path.join(directory, "existing")),
        "make a directory": lambda: os.mkdir(os.path.join(directory, "dir")),
        "subprocess": lambda: subprocess.run(["touch", marker], check=False),
        "fork": lambda: os.fork(),
        "exec": lambda: os.execv("/bin/true", ["true"]),
        "signal the server": lambda: os.kill(os.getppid(), 0),
    }
    out = {name: _attempt(fn) for name, fn in tries.items()}
    out["os.system exit status"] = os.system(f"touch {marker}")     # the shell never runs (no process, no exec)
    out["read a file"] = _attempt(lambda: len(open(os.path.join(directory, "existing")).read()))
    return out


@pytest.fixture(scope="module")
def live(model, tmp_path_factory):
    directory = tmp_path_factory.mktemp("confine")
    (directory / "existing").write_text("before")
    server = Server(model, api_keys=[KEY], allow_code=True, exact=True, max_wait_ms=5, timeout=20,
                    isolation=ProcessIsolation(code_worker=False, hang_timeout=2.0, memory_limit=512 << 20))
    server.intervention("escape")(escape)
    server.batcher.start()
    srv = Live(server)
    srv.directory = directory
    yield srv
    srv.close()


def test_escaped_code_reaches_no_socket_file_or_process(live):
    d = live.directory

    async def go():
        async with AsyncClient(live.url, api_key=KEY, timeout=60) as c:
            return await c.trace(PROMPTS[0], "escape", directory=str(d))
    out = asyncio.run(asyncio.wait_for(go(), 60))
    allowed = {k: v for k, v in out.items() if isinstance(v, str) and v.startswith("ALLOWED") and k != "read a file"}
    assert not allowed, allowed
    assert all(v == "refused:1" for k, v in out.items() if k not in ("os.system exit status", "read a file")), out
    assert out["os.system exit status"] != 0 and out["read a file"] == "ALLOWED:6"
    assert sorted(p.name for p in d.iterdir()) == ["existing"] and (d / "existing").read_text() == "before"


def test_the_confined_worker_still_serves_and_says_it_is_confined(live, model):
    async def go():
        async with AsyncClient(live.url, api_key=KEY, timeout=60) as c:
            return await asyncio.gather(c.trace(PROMPTS[0], LAST), c.trace(PROMPTS[1], LAST),
                                        c.generate(PROMPTS[1], max_new_tokens=4))
    a, b, g = asyncio.run(asyncio.wait_for(go(), 60))

    async def last(m):
        return (await m.lm_head.output)[:, -1].clone()
    assert torch.equal(a, model.trace(PROMPTS[0], last)) and torch.equal(b, model.trace(PROMPTS[1], last))
    assert g.text == model.generate(PROMPTS[1], max_new_tokens=4).text
    h = httpx.get(f"{live.url}/v1/health", timeout=10).json()
    assert h["confinement"]["active"] is True
    worker = h["workers"]["trusted"]
    assert worker["confined"] is True and worker["restarts"] == 0
    assert confine.status_of(worker["pid"]) == {"seccomp": 2, "no_new_privs": 1}   # the kernel's word
    assert confine.status_of()["seccomp"] == 0                                    # the server is not confined


def test_in_process_code_is_said_to_be_unconfined(model, caplog):
    with caplog.at_level("WARNING", logger="asyncinterp.serve"):
        server = Server(model, allow_code=True)
    assert server.confinement["active"] is False and "isolation='thread'" in server.confinement["reason"]
    assert any("NOT confined" in r.getMessage() for r in caplog.records)
    server.batcher.close()


def test_a_platform_without_seccomp_is_said_at_start(model, caplog, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyseccomp", None)          # as where the binding is not installed
    assert "libseccomp binding is missing" in confine.probe()
    with caplog.at_level("WARNING", logger="asyncinterp.serve"):
        server = Server(model, allow_code=True, isolation="process")
    assert server.confinement["active"] is False and "pyseccomp" in server.confinement["reason"]
    assert any("NOT confined" in r.getMessage() for r in caplog.records)
    server.batcher.close()
    with pytest.raises(confine.ConfinementUnavailable, match="confine=True"):
        Server(model, allow_code=True, isolation=ProcessIsolation(confine=True))
