"""Worker processes start with no thread state of the server (issue 30): from the fork server, never forked
from the server process, with the model's weights shared and the registrations sent.

Inside a Ray Serve replica the server process always runs other threads (Ray's gRPC); a worker forked from it
hung in about one start in 22. Here the server process runs several busy threads, one of them holding a lock
that the worker's code also uses, while the workers start; the worker must start with one thread, a fresh copy
of that lock (free), the module state of a fresh import, a parent that is not the server, and the server's
weight pages mapped (shared, not copied).
"""

import os
import threading
import time

import pytest
import torch

from asyncinterp.models import tiny
from asyncinterp.serve import Client, Server
from asyncinterp.serve.workers.supervisor import ProcessIsolation
from remote_helpers import Live
from serve_helpers import one_thread  # noqa: F401 - fixture found by name

HELD = threading.Lock()          # held by a server thread while the workers start
MARK = ["as imported"]           # changed in the server at run time (a fork would carry the change)
PROMPT = "The quick brown fox"


async def probe(m):
    """Registered (trusted) code that reports what its worker process inherited."""
    await m.lm_head.output
    free = HELD.acquire(timeout=0.5)
    if free:
        HELD.release()
    weight = m.module.transformer.wte.weight
    return {"pid": os.getpid(), "ppid": os.getppid(), "lock_free": free, "mark": MARK[0],
            "shared": bool(weight.is_shared()), "file": mapped_file(weight.data_ptr())}


def mapped_file(address: int) -> str:
    """The file (device:inode name) of this process's mapping that holds ``address``."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if start <= address < end:
                return f"{parts[3]}:{parts[4]} {parts[5] if len(parts) > 5 else ''}"
    return ""


@pytest.fixture(scope="module")
def busy_server():
    """A supervised server whose process runs 8 other threads (one holding HELD) while its workers start."""
    stop = threading.Event()
    holding = threading.Event()

    def hold():
        with HELD:
            holding.set()
            stop.wait()

    def spin():
        while not stop.is_set():
            sum(range(1000))
            time.sleep(0.001)

    threads = [threading.Thread(target=hold, daemon=True)] + [threading.Thread(target=spin, daemon=True)
                                                               for _ in range(7)]
    for t in threads:
        t.start()
    holding.wait(5)
    MARK[0] = "changed in the server"
    server = Server(tiny("gpt2"), allow_code=True, max_wait_ms=1, timeout=60, builtin_interventions=False,
                    isolation=ProcessIsolation(hang_timeout=5.0))
    server.intervention("probe")(probe)
    bias = torch.full((1,), 3.0)

    async def shifted(m):
        """A closure over a tensor of the server (sent by value: it cannot be imported)."""
        return (await m.lm_head.output)[:, -1, :2] + bias
    server.intervention("shifted")(shifted)
    server_threads = len(os.listdir("/proc/self/task"))
    t0 = time.perf_counter()
    server.batcher.start()
    started = time.perf_counter() - t0
    live = Live(server)
    try:
        yield server, live, server_threads, started
    finally:
        live.close()
        stop.set()
        MARK[0] = "as imported"


def test_a_worker_starts_with_no_thread_state_of_the_server(busy_server):
    server, live, server_threads, started = busy_server
    assert server_threads >= 9, server_threads
    with Client(live.url, timeout=60) as c:
        got = c.trace(PROMPT, "probe")
    for pool in server.batcher.pools.values():
        assert pool.worker.threads_at_start == 1, (pool.name, pool.worker.threads_at_start)
    assert got["ppid"] != os.getpid()              # not forked from the server: its parent is the fork server
    assert got["lock_free"] is True                # the lock a server thread holds is free there (fresh import)
    assert got["mark"] == "as imported"            # module state as imported, not the server's memory
    print(f"\nworkers ready in {1000 * started:.0f} ms (fork server start included)")


def test_a_registered_closure_over_a_tensor_reaches_the_worker(busy_server):
    server, live, _, _ = busy_server
    with Client(live.url, timeout=60) as c:
        got = c.trace(PROMPT, "shifted")

    async def first_two(m):
        return (await m.lm_head.output)[:, -1, :2].clone()
    assert torch.allclose(got, server.model.trace(PROMPT, first_two) + 3.0, atol=1e-5)


def test_the_weights_are_shared_not_copied(busy_server):
    server, live, _, _ = busy_server
    with Client(live.url, timeout=60) as c:
        got = c.trace(PROMPT, "probe")
    assert got["shared"]
    ours = mapped_file(server.model.module.transformer.wte.weight.data_ptr())
    assert ours == got["file"] and not ours.startswith("00:00:0 "), (ours, got["file"])   # one shared file


def test_a_remote_job_and_a_session_run_in_the_workers_as_locally(busy_server):
    """``ai.remote`` (``/v1/jobs``, ``/v1/sessions``): rebuilt and run in the code worker from the server it was
    sent, with a closure over a client tensor and two invokes sharing a future."""
    import asyncinterp as ai
    server, live, _, _ = busy_server
    direction = torch.linspace(-1.0, 1.0, 64)

    async def steer(m):
        h = await m.transformer.h[1].output
        h[:] = h + 4.0 * direction
        return (await m.lm_head.output)[:, -1].clone()

    async def session(model):
        return [await model.atrace(PROMPT, steer), await model.atrace("Hello", steer)]

    with ai.remote(live.url, timeout=60) as lm, torch.no_grad():
        assert torch.allclose(lm.trace(PROMPT, steer), server.model.trace(PROMPT, steer), atol=1e-5)
        remote = lm.session(session)
    import asyncio
    with torch.no_grad():
        local = asyncio.run(session(server.model))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(remote, local))


def test_submitted_code_still_runs_confined_and_answers_as_locally(busy_server):
    server, live, _, _ = busy_server
    code = "async def f(m):\n    return (await m.lm_head.output)[:, -1].clone()\n"
    with Client(live.url, timeout=60) as c:
        remote = c.trace(PROMPT, code)
        health = c.health()

    async def last(m):
        return (await m.lm_head.output)[:, -1].clone()
    assert torch.allclose(remote, server.model.trace(PROMPT, last), atol=1e-5)
    if server.confinement.get("active"):
        assert health["workers"]["code"]["confined"] is True
