"""``asyncinterp serve DIR --tensor-parallel-size 2`` on transformers: a served intervention equals TP=1.

The command starts its two ranks itself (no torchrun); rank 0 serves HTTP and
rank 1 follows its batches. A steering request on a column-parallel layer
(``mlp.up_proj``: sharded across the ranks) and a steered generation are
compared with the same builtin intervention run on the unsharded model in
this process. Stopping the command leaves no rank behind.
"""

import functools
import os
import subprocess
import sys

import pytest
import torch

import asyncinterp as ai
from asyncinterp.distributed.launch import free_port
from asyncinterp.serve import builtins
from asyncinterp.client.clients import Client
from serve_helpers import stop_server, wait_healthy
from tp_checks import build_llama_dir

pytestmark = pytest.mark.tp

VECTOR = torch.linspace(-1.0, 1.0, 128)
PARAMS = {"module": "model.layers.0.mlp.up_proj", "vector": VECTOR, "strength": 3.0, "k": 5}


def _children(pid):
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tp-serve") / "llama")
    build_llama_dir(path)
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", ASYNCINTERP_TP_TIMEOUT="60")
    proc = subprocess.Popen([sys.executable, "-m", "asyncinterp.serve.cli", path, "--tensor-parallel-size", "2",
                             "--port", str(port), "--log-format", "json", "--max-wait-ms", "1"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, timeout=240)
        ranks = _children(proc.pid)
        with Client(url) as client:
            yield client, path, proc, ranks
    finally:
        if proc.poll() is None:
            stop_server(proc)


@pytest.fixture(scope="module")
def reference(served):
    _, path, _, _ = served
    return ai.LanguageModel.from_pretrained(path)


def test_the_command_started_two_ranks(served):
    _, _, _, ranks = served
    assert len(ranks) == 2


def test_served_trace_with_sharded_steer_equals_tp1(served, reference):
    client, *_ = served
    got = client.trace("The quick brown fox", "steer", params=PARAMS)
    with torch.no_grad():
        want = reference.trace("The quick brown fox", functools.partial(builtins.steer, **PARAMS))
    assert torch.equal(got["ids"], want["ids"])
    assert torch.allclose(got["probs"], want["probs"], atol=1e-6, rtol=1e-4)
    plain = reference.trace("The quick brown fox", functools.partial(builtins.top_k, k=5))
    assert not torch.equal(plain["ids"], want["ids"])        # the steering mattered


def test_served_generation_with_per_step_steer_equals_tp1(served, reference):
    client, *_ = served
    got = client.generate("Hello world", "steer", max_new_tokens=5, params=PARAMS)
    with torch.no_grad():
        want = reference.generate("Hello world", functools.partial(builtins.steer, **PARAMS), max_new_tokens=5)
    assert got.tokens == want.tokens.tolist()
    assert torch.equal(got.result["ids"], want.result["ids"])


def test_stopping_the_command_leaves_no_rank(served):
    _, _, proc, ranks = served
    stop_server(proc)
    assert proc.poll() is not None
    alive = [pid for pid in ranks if os.path.exists(f"/proc/{pid}") and
             open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
    assert alive == []
