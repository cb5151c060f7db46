"""``asyncinterp serve DIR --tensor-parallel-size 2 --ray-address ADDR``: a served model sharded over two Ray nodes.

The module builds one local Ray cluster (a head node with no CPUs, two
worker nodes with one CPU each) and starts the real command line as a
subprocess joining it: the two ranks run as Ray actors on the two nodes
(rank 0 serves the app on its node, rank 1 follows), and the command serves
the front (``serve/scale/tp_front.py``) that relays requests to rank 0. Served
answers, through the package's ``Client`` and through httpx on the
OpenAI-compatible endpoint, are compared with the same intervention run on
the unsharded model in this process.

Then a node is lost under the model (``Cluster.remove_node`` on rank 1's
node) while a request runs: that request and the next ones fail at once with
a clear 503 ``ranks_lost``, ``/v1/health`` is 503 and says why, and once a
node is added again the ranks are placed again by themselves, health is 200
and answers equal TP=1 again. Stopping the command leaves no rank actor.
Every wait is bounded.
"""

import functools
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

pytest.importorskip("ray")
import ray  # noqa: E402

import asyncinterp as ai  # noqa: E402
from asyncinterp.distributed.launch import free_port  # noqa: E402
from asyncinterp.distributed.ray_ranks import NAMESPACE  # noqa: E402
from asyncinterp.serve import RemoteError, builtins  # noqa: E402
from asyncinterp.client.clients import Client  # noqa: E402
from ray_helpers import add_worker_node, stop_cluster, two_node_cluster  # noqa: E402
from serve_helpers import stop_server, wait_healthy  # noqa: E402
from tp_checks import build_llama_dir  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.tp, pytest.mark.slow]

VECTOR = torch.linspace(-1.0, 1.0, 128)
PARAMS = {"module": "model.layers.0.mlp.up_proj", "vector": VECTOR, "strength": 3.0, "k": 5}

INTERVENTIONS = '''
"""Test intervention: holds the forward for a while between two sharded points (a node can be lost meanwhile)."""
import time


def register(server):
    @server.intervention("slow_top")
    async def slow_top(m, seconds: float = 4.0):
        await m.model.layers[0].self_attn.q_proj.output
        time.sleep(seconds)
        return (await m.lm_head.output)[:, -1].argmax(-1)
'''


class Served:
    """The cluster, the command line joined to it, and a client."""

    def __init__(self, tmp):
        self.path = str(tmp / "llama")
        build_llama_dir(self.path)
        interventions = tmp / "slow.py"
        interventions.write_text(INTERVENTIONS)
        self.cluster, self.nodes = two_node_cluster(NAMESPACE)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", ASYNCINTERP_TP_TIMEOUT="60")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncinterp.cli", "serve", self.path, "--tensor-parallel-size", "2",
             "--ray-address", self.cluster.address, "--port", str(self.port), "--log-format", "json",
             "--max-wait-ms", "1", "--interventions", str(interventions), "--tp-placement-timeout", "5"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wait_healthy(self.proc, self.url, timeout=300)
        self.client = Client(self.url)

    def health(self):
        r = httpx.get(f"{self.url}/v1/health", timeout=10)
        return r.status_code, r.json()

    def node_of_rank(self, rank):
        _, h = self.health()
        node_id = h["tensor_parallel"]["ranks"][rank]["node_id"]
        return next(n for n in self.nodes if n.node_id == node_id)

    def close(self):
        try:
            self.client.close()
            if self.proc.poll() is None:
                stop_server(self.proc, timeout=60)
        finally:
            stop_cluster(self.cluster)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = Served(tmp_path_factory.mktemp("tp-ray-serve"))
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def reference(served):
    return ai.LanguageModel.from_pretrained(served.path)


def steered_equals_tp1(served, reference):
    got = served.client.trace("The quick brown fox", "steer", params=PARAMS)
    with torch.no_grad():
        want = reference.trace("The quick brown fox", functools.partial(builtins.steer, **PARAMS))
    assert torch.equal(got["ids"], want["ids"])
    assert torch.allclose(got["probs"], want["probs"], atol=1e-5, rtol=1e-4)
    return want


def test_health_names_two_ranks_on_two_worker_nodes(served):
    status, h = served.health()
    assert status == 200 and h["status"] == "ok"
    tp = h["tensor_parallel"]
    assert tp["size"] == 2 and tp["status"] == "ready" and tp["losses"] == 0
    placed = [r["node_id"] for r in tp["ranks"]]
    assert sorted(placed) == sorted(n.node_id for n in served.nodes)     # one rank per worker node


def test_served_trace_with_sharded_steer_equals_tp1(served, reference):
    want = steered_equals_tp1(served, reference)
    plain = reference.trace("The quick brown fox", functools.partial(builtins.top_k, k=5))
    assert not torch.equal(plain["ids"], want["ids"])        # the steering mattered


def test_served_generation_with_per_step_steer_equals_tp1(served, reference):
    got = served.client.generate("Hello world", "steer", max_new_tokens=5, params=PARAMS)
    with torch.no_grad():
        want = reference.generate("Hello world", functools.partial(builtins.steer, **PARAMS), max_new_tokens=5)
    assert got.tokens == want.tokens.tolist()
    assert torch.equal(got.result["ids"], want.result["ids"])


def test_openai_completion_is_relayed(served, reference):
    r = httpx.post(f"{served.url}/v1/completions", timeout=60, json={
        "model": served.path, "prompt": "Hello world", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    want = reference.generate("Hello world", max_new_tokens=4)
    assert r.json()["choices"][0]["text"] == reference.tokenizer.decode(want.tokens.reshape(-1)[-4:])


def test_an_ordinary_error_passes_through_at_once(served):
    t0 = time.monotonic()
    with pytest.raises(RemoteError) as info:
        served.client.trace("The quick brown fox", "steer", params=dict(PARAMS, module="model.no_such_layer"))
    assert time.monotonic() - t0 < 3                   # no wait for a loss that did not happen
    assert info.value.status == 400 and "no_such_layer" in str(info.value)
    assert served.health()[0] == 200


def test_a_lost_node_fails_requests_clearly_and_health_is_503_until_the_model_is_back(served, reference):
    node = served.node_of_rank(1)
    caught = {}

    def slow():
        t0 = time.monotonic()
        try:
            caught["result"] = served.client.trace("The quick brown fox", "slow_top", params={"seconds": 3.0})
        except RemoteError as exc:
            caught["error"] = exc
        caught["seconds"] = time.monotonic() - t0

    worker = threading.Thread(target=slow)
    worker.start()
    time.sleep(1.5)                                    # the request is inside its forward, on both ranks
    served.cluster.remove_node(node)
    served.nodes.remove(node)
    worker.join(60)
    assert not worker.is_alive()
    err = caught.get("error")
    assert err is not None, caught                     # the request under the loss failed ...
    assert err.status == 503 and err.kind == "ranks_lost", (err.status, err.kind, str(err))
    assert "was lost while this request ran" in str(err) and "rank 1" in str(err)   # ... and says why
    assert "Rank 0 answered HTTP" in str(err)          # with rank 0's own error (it survived: rank 1's node went)
    assert caught["seconds"] < 30

    status, h = served.health()
    assert status == 503 and h["status"] == "unavailable"
    assert h["tensor_parallel"]["losses"] == 1 and h["reason"]
    t0 = time.monotonic()
    with pytest.raises(RemoteError) as info:           # a new request fails at once, clearly
        served.client.trace("The quick brown fox", "steer", params=PARAMS)
    assert time.monotonic() - t0 < 5
    assert info.value.status == 503 and "not available" in str(info.value) and "retry later" in str(info.value)

    served.nodes.append(add_worker_node(served.cluster))
    deadline = time.monotonic() + 120
    while served.health()[0] != 200:                   # placed again by itself, once the cluster has two nodes
        assert served.proc.poll() is None
        assert time.monotonic() < deadline, served.health()
        time.sleep(0.5)
    _, h = served.health()
    assert h["tensor_parallel"]["status"] == "ready" and h["tensor_parallel"]["losses"] == 1
    assert node.node_id not in [r["node_id"] for r in h["tensor_parallel"]["ranks"]]
    steered_equals_tp1(served, reference)              # the model is back, with TP=1's answers


def rank_actors_after_stop(served) -> list:
    """Stop the command (if it still runs); the rank actors still alive 30 s later at most."""
    if served.proc.poll() is None:
        stop_server(served.proc, timeout=60)
    deadline = time.monotonic() + 30
    while True:
        alive = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a.get("namespace") == NAMESPACE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def test_stopping_the_command_leaves_no_rank_actor(served):
    assert rank_actors_after_stop(served) == []
    assert served.proc.poll() is not None


def test_a_model_that_does_not_load_ends_the_command_with_the_ranks_error(served, tmp_path):
    assert rank_actors_after_stop(served) == []        # the cluster's two nodes are free for this command
    bad = tmp_path / "bad-model"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "no-such-architecture"}')
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "asyncinterp.cli", "serve", str(bad), "--tensor-parallel-size", "2",
                          "--ray-address", served.cluster.address, "--port", str(free_port())],
                         env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "of the tensor-parallel model stopped" in out.stderr and "no-such-architecture" in out.stderr, \
        out.stderr[-3000:]
    assert time.monotonic() - t0 < 200
