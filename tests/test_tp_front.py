"""The front of a tensor-parallel model on Ray nodes (``serve/scale/tp_front.py``) while its ranks are not there.

No Ray and no ranks: a :class:`RankState` set as the supervisor sets it. While
the ranks are starting or lost, ``/v1/health`` is 503 with the reason, and
every request gets 503 ``ranks_lost`` at once in the server's error shape
(msgpack on the native endpoints, OpenAI's JSON on the OpenAI ones), with
``Retry-After``. The relay itself, the loss under a running request and the
return to health are tested on a real 2-node cluster in
``test_tp_ray_serve.py``. Last: a ``--ray-address`` where no cluster
answers is a clear error at once.
"""

from starlette.testclient import TestClient

from asyncinterp.serve import wire
from asyncinterp.serve.scale.tp_front import RankState, front_app

NODES = [{"node_id": "a" * 56, "ip": "10.0.0.1"}, {"node_id": "b" * 56, "ip": "10.0.0.2"}]


def client(state):
    return TestClient(front_app(state, "llama", timeout=5.0))


def test_health_is_503_while_the_ranks_start():
    state = RankState(2)
    with client(state) as c:
        r = c.get("/v1/health")
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    body = r.json()
    assert body["status"] == "unavailable" and body["reason"] == "the ranks are starting"
    assert body["tensor_parallel"]["size"] == 2 and body["tensor_parallel"]["status"] == "starting"


def test_a_lost_rank_is_503_ranks_lost_on_every_endpoint_with_the_reason():
    state = RankState(2)
    state.set("ready", "", upstream="http://10.0.0.1:1", nodes=NODES)
    state.set("lost", "rank 1 on node bbbbbbbbbbbb was lost (its node left the Ray cluster)")
    state.set("lost", "rank 1 on node bbbbbbbbbbbb was lost (its node left the Ray cluster)")   # counted once
    with client(state) as c:
        health = c.get("/v1/health")
        native = c.post("/v1/trace", content=wire.packb({"input": "hi", "intervention": "top_k"}))
        openai = c.post("/v1/completions", json={"model": "llama", "prompt": "hi"})
    assert health.status_code == 503
    tp = health.json()["tensor_parallel"]
    assert tp["losses"] == 1 and tp["ranks"][1]["node_id"] == "b" * 56 and "rank 1" in tp["reason"]

    assert native.status_code == 503 and native.headers["retry-after"] == "1"
    err = wire.unpackb(native.content)["error"]
    assert err["kind"] == "ranks_lost" and err["type"] == "RanksLost"
    assert "rank 1 on node bbbbbbbbbbbb was lost" in err["message"] and "retry later" in err["message"]

    assert openai.status_code == 503
    oerr = openai.json()["error"]
    assert oerr["code"] == "ranks_lost" and oerr["type"] == "overloaded_error" and "was lost" in oerr["message"]


def test_ready_without_a_reachable_rank_0_is_503_not_a_hang():
    state = RankState(2)
    state.set("ready", "", upstream="http://127.0.0.1:9", nodes=NODES)     # nothing listens on port 9
    with client(state) as c:
        r = c.get("/v1/health")
    assert r.status_code == 503 and "rank 0 does not answer" in r.json()["reason"]


def test_a_ray_address_with_no_cluster_is_a_clear_error_at_once(tmp_path):
    import socket
    import subprocess
    import sys
    import time
    with socket.socket() as s:            # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "asyncinterp.cli", "serve", str(tmp_path), "--tensor-parallel-size",
                          "2", "--ray-address", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and f"no Ray cluster answers at '127.0.0.1:{port}'" in out.stderr, out.stderr[-2000:]
    assert "ray start --head" in out.stderr and time.monotonic() - t0 < 60
