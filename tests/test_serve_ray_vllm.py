"""A vLLM replica on Ray Serve: ``asyncinterp serve DIR --engine vllm --replicas 1`` (a local Ray cluster).

The command line runs as a subprocess (its own small local cluster); the
answers through Ray Serve's proxy (OpenAI completion, an OpenAI stream with
an intervention, a native trace) must equal those of ``ai.VLLM`` over the
same weights in this process, which starts only after the replica is gone
(one vLLM engine at a time).
"""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch

pytest.importorskip("ray")

import asyncinterp as ai  # noqa: E402
from asyncinterp.serve import Client  # noqa: E402
from test_serve_http import free_port  # noqa: E402
from vllm_helpers import ENGINE, tiny_dir  # noqa: E402,F401 - fixtures are found by name

pytestmark = [pytest.mark.ray, pytest.mark.vllm]

PROMPT = "The quick brown fox jumps"


def ask(url):
    out = {}
    r = httpx.post(f"{url}/v1/completions", timeout=120,
                   json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    out["text"] = r.json()["choices"][0]["text"]
    r = httpx.post(f"{url}/v1/completions", timeout=120,
                   json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True,
                         "asyncinterp": {"intervention": "top_k", "params": {"k": 3}}})
    events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]", r.text[-500:]
    out["stream"] = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    out["top"] = Client(url).trace(PROMPT, "top_k", k=3)
    return out


def test_a_vllm_replica_answers_as_the_engine_does(tiny_dir):  # noqa: F811
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "asyncinterp.serve.scale.replicas", tiny_dir, "--engine", "vllm", "--replicas", "1",
           "--port", str(port), "--served-model-name", "tiny", "--log-level", "warning",
           "--max-model-len", str(ENGINE["max_model_len"]), "--kv-cache-memory-bytes", str(ENGINE["kv_cache_memory_bytes"]),
           "--seed", str(ENGINE["seed"])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            try:
                health = httpx.get(f"{url}/v1/health", timeout=3)
                if health.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the vLLM replica did not come up within 240 s"
            time.sleep(1)
        assert health.headers["x-asyncinterp-replica"]
        got = ask(url)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0
    model = ai.VLLM(tiny_dir, **ENGINE)
    try:
        want = model.generate(PROMPT, max_new_tokens=4)
        top = model.trace(PROMPT, _top3)
    finally:
        model.close()
    assert got["text"] == got["stream"] == want.text
    torch.testing.assert_close(got["top"]["probs"], top["probs"], rtol=1e-5, atol=1e-6)
    assert torch.equal(got["top"]["ids"], top["ids"])


async def _top3(m):
    logits = (await m.logits).float()
    p, ids = logits.softmax(-1).topk(3, dim=-1)
    return {"ids": ids, "probs": p}
