"""Replicated serving on Ray Serve (``asyncinterp serve ... --replicas 2``) on a local multi-node Ray cluster.

The module starts, once: a ``ray.cluster_utils.Cluster`` (a head node with
no CPUs for replicas, two worker nodes with one CPU each, so each replica
lands on its own node), the real command line as a subprocess joining it
(``--replicas 2 --ray-address ...``: tiny GPT-2, an API key, submitted code
allowed, so process isolation is on in every replica), and, as the
reference, a single in-process server built from the same command line
(``cli.make_server``) on uvicorn. Clients are real: httpx, the package's
``Client`` and the ``openai`` package, through Ray Serve's proxy.

Greedy answers through the replicas must be bit-equal to the single
server's (same weights, one BLAS thread, ``--exact --deterministic``). The
last test kills one replica (SIGKILL) in the middle of a 200-request load
run: every request must succeed or get a clear error, none may run twice,
and the service must come back with two replicas. Every wait is bounded.
"""

import argparse
import asyncio
import collections
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
import torch

pytest.importorskip("ray")
import ray  # noqa: E402
from ray import serve  # noqa: E402

from asyncinterp.serve import AsyncClient, Client, RemoteError, cli  # noqa: E402
from asyncinterp.serve.scale.replica_loss import PROXY_CALLBACK, PROXY_CALLBACK_ENV  # noqa: E402
from ray_helpers import stop_cluster, two_node_cluster  # noqa: E402
from serve_helpers import SPIN, one_thread, stop_server  # noqa: E402,F401 - fixtures are found by name
from test_remote import _patching, patching_sweep  # noqa: E402 - the remote tests' patching job and session
from test_serve_http import Live, free_port  # noqa: E402

pytestmark = pytest.mark.ray

KEY = "ray-test-key"
NAME = "tiny-gpt2"
PROMPTS = ["The cat sat on the", "A dog ran into a", "Paris is the capital of", "Once upon a time there was a"]
REPLICA = "x-asyncinterp-replica"

INTERVENTIONS = '''
"""Test interventions: `mark` has a visible effect (a line in a file) before it answers."""
MARKS = {marks!r}


def register(server):
    @server.intervention("mark")
    async def mark(m, tag: int):
        top = (await m.lm_head.output)[:, -1].argmax(-1)
        with open(MARKS, "a") as f:
            f.write(f"{{tag}}\\n")
        return top
'''


def serve_argv(interventions: str) -> list:
    return [NAME, "--api-key", KEY, "--allow-code", "--exact", "--deterministic", "--hang-timeout", "1",
            "--interventions", interventions, "--log-level", "warning"]


def replica_ids() -> set:
    return {a["name"].rsplit("#", 1)[-1] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::asyncinterp#")}


def replica_actor(rid: str):
    return ray.get_actor(f"SERVE_REPLICA::asyncinterp#AsyncinterpServer#{rid}", namespace="serve")


def running_replicas() -> int:
    app = serve.status().applications.get("asyncinterp")
    if app is None or "AsyncinterpServer" not in app.deployments:
        return 0
    dep = app.deployments["AsyncinterpServer"]
    return dep.replica_states.get("RUNNING", 0) if dep.status.value == "HEALTHY" else 0


class Deployment:
    """The cluster, the ``--replicas 2`` command line joined to it, and the single reference server."""

    def __init__(self, tmp):
        self.marks = str(tmp / "marks.txt")
        self.interventions = str(tmp / "interventions.py")
        with open(self.interventions, "w") as f:
            f.write(INTERVENTIONS.format(marks=self.marks))
        self.env_before = os.environ.get(PROXY_CALLBACK_ENV)
        os.environ[PROXY_CALLBACK_ENV] = PROXY_CALLBACK     # the cluster's processes inherit it (the proxy's 502)
        self.cluster, self.nodes = two_node_cluster()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "asyncinterp.serve.scale.replicas", *serve_argv(self.interventions), "--replicas", "2",
               "--ray-address", self.cluster.address, "--port", str(self.port), "--max-replicas-per-node", "1"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        # the reference (built while the replicas start): one server in this process, from the same command line
        parser = argparse.ArgumentParser()
        cli.configure(parser)
        args = parser.parse_args(serve_argv(self.interventions))
        model = cli.build_model(args)
        self.single = Live(cli.make_server(args, model, cli.api_keys(args), logging.getLogger("test")))
        self.wait_ready(initial=True)

    def wait_ready(self, timeout=150.0, initial=False):
        deadline = time.monotonic() + timeout
        while True:
            if initial and self.proc.poll() is not None:
                raise AssertionError(f"asyncinterp serve --replicas exited: {self.proc.stderr.read()[-3000:]}")
            try:
                ok = httpx.get(f"{self.url}/v1/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok and running_replicas() == 2 and len(replica_ids()) == 2:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the replicas did not come up within {timeout:g} s: {serve.status()}")
            time.sleep(0.5)

    def close(self):
        try:
            if self.single is not None:
                self.single.close()
            err, _ = stop_server(self.proc, timeout=60)
        finally:
            stop_cluster(self.cluster)
            if self.env_before is None:
                os.environ.pop(PROXY_CALLBACK_ENV, None)
            else:
                os.environ[PROXY_CALLBACK_ENV] = self.env_before
        assert self.proc.returncode == 0, err[-3000:]


@pytest.fixture(scope="module")
def dep(tmp_path_factory, one_thread):  # noqa: F811
    d = Deployment(tmp_path_factory.mktemp("ray"))
    try:
        yield d
    finally:
        d.close()


def headers():
    return {"Authorization": f"Bearer {KEY}"}


def openai_client(url):
    import openai
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)


def answered_by(url, want: set, timeout=30.0) -> set:
    """The replicas that answer ``/v1/health`` (asked until all of ``want`` answered, or ``timeout``)."""
    seen = set()
    deadline = time.monotonic() + timeout
    while seen != want and time.monotonic() < deadline:
        r = httpx.get(f"{url}/v1/health", timeout=10)
        assert r.status_code == 200
        seen.add(r.headers[REPLICA])
    return seen


# --------------------------------------------------------------------------- the deployment
def test_two_replicas_on_two_nodes_answer(dep):
    ids = replica_ids()
    nodes = {ray.get(replica_actor(rid).__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()),
                     timeout=30) for rid in ids}
    assert len(nodes) == 2 and ray.get_runtime_context().get_node_id() not in nodes  # not on the head node
    health = httpx.get(f"{dep.url}/v1/health", timeout=10).json()
    assert health["status"] == "ok" and health["isolation"] == "process"    # supervised workers in each replica
    seen = set()
    with httpx.Client(headers=headers(), timeout=30) as http:
        for _ in range(40):
            r = http.get(f"{dep.url}/v1/models")
            assert r.status_code == 200 and r.json()["data"][0]["id"] == NAME
            seen.add(r.headers[REPLICA])
            if seen == ids:
                break
    assert seen == ids             # Ray Serve's router spreads requests over both replicas


# --------------------------------------------------------------------------- equal to a single server
async def last_hidden(m):
    return (await m.transformer.h[1].output)[:, -1].clone()


def test_native_endpoints_equal_single_server(dep):
    ray_client = Client(dep.url, api_key=KEY)
    one = Client(dep.single.url, api_key=KEY)
    for prompt in PROMPTS:
        for _ in range(3):          # several answers, from both replicas
            got = ray_client.trace(prompt, "top_k", k=5)
            want = one.trace(prompt, "top_k", k=5)
            assert torch.equal(got["ids"], want["ids"]) and torch.equal(got["probs"], want["probs"])
        # submitted code (the sandbox, the code worker) and a registered read
        assert torch.equal(ray_client.trace(prompt, last_hidden), one.trace(prompt, last_hidden))
        got = ray_client.trace(prompt, "read", module="transformer.h.0", position=-1)
        assert torch.equal(got, one.trace(prompt, "read", module="transformer.h.0", position=-1))
        vector = torch.linspace(-1, 1, got.shape[-1])
        g = ray_client.generate(prompt, "steer", module="transformer.h.0", vector=vector, strength=3.0,
                                max_new_tokens=6)
        w = one.generate(prompt, "steer", module="transformer.h.0", vector=vector, strength=3.0, max_new_tokens=6)
        assert (g.tokens, g.text) == (w.tokens, w.text)
        plain = ray_client.generate(prompt, max_new_tokens=6)
        assert (plain.tokens, plain.text) == tuple(getattr(one.generate(prompt, max_new_tokens=6), k)
                                                   for k in ("tokens", "text"))


def test_openai_endpoints_equal_single_server(dep):
    ray_oa, one_oa = openai_client(dep.url), openai_client(dep.single.url)
    for prompt in PROMPTS:
        for _ in range(2):
            kw = dict(model=NAME, prompt=prompt, max_tokens=6, temperature=0)
            got, want = ray_oa.completions.create(**kw), one_oa.completions.create(**kw)
            assert got.choices[0].text == want.choices[0].text
            assert got.usage == want.usage and got.choices[0].finish_reason == want.choices[0].finish_reason
        ablated = dict(model=NAME, prompt=prompt, max_tokens=6, temperature=0,
                       extra_body={"asyncinterp": {"intervention": "ablate", "params": {"module": "transformer.h.1", "k": 4}}})
        assert ray_oa.completions.create(**ablated).choices[0].text == \
            one_oa.completions.create(**ablated).choices[0].text


def test_streaming_through_the_proxy(dep):
    ray_oa = openai_client(dep.url)
    one = Client(dep.single.url, api_key=KEY)
    for prompt in PROMPTS[:2]:
        want = one.generate(prompt, max_new_tokens=8)
        chunks = list(ray_oa.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0, stream=True))
        assert len(chunks) >= 8                        # token by token, not one buffered answer
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
        events = list(Client(dep.url, api_key=KEY).stream_generate(prompt, max_new_tokens=8))
        assert [e["token"] for e in events if e["event"] == "token"] == want.tokens
        assert events[-1]["event"] == "done" and events[-1]["result"].text == want.text


def test_keys_sandbox_and_isolation_hold_through_the_proxy(dep):
    assert httpx.post(f"{dep.url}/v1/completions", json={"model": NAME, "prompt": "hi"}, timeout=30).status_code == 401
    bad = httpx.post(f"{dep.url}/v1/completions", json={"model": NAME, "prompt": "hi"}, timeout=30,
                     headers={"Authorization": "Bearer wrong"})
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
    client = Client(dep.url, api_key=KEY)
    with pytest.raises(RemoteError) as refused:
        client.trace("hi", "async def f(m):\n    import os\n    return os.getpid()\n")
    assert refused.value.status == 400 and "os" in str(refused.value)
    with pytest.raises(RemoteError) as cut:            # a runaway loop: its compute budget ends it
        client.trace("hi", SPIN, timeout=5)
    assert cut.value.status == 504
    freeze = textwrap.dedent("""
        async def f(m):
            h = await m.transformer.h[0].output
            return any(iter(int, 1))
        """)                                           # a C-level loop holding the GIL: its worker is killed
    with pytest.raises(RemoteError) as hung:
        client.trace("hi", freeze, timeout=20)
    assert hung.value.status == 504 and hung.value.kind == "hung"
    assert torch.equal(client.trace(PROMPTS[0], last_hidden),
                       Client(dep.single.url, api_key=KEY).trace(PROMPTS[0], last_hidden))


# --------------------------------------------------------------------------- a remote model through the replicas
def test_a_remote_model_runs_through_the_replicas_as_against_one_server(dep):
    """ai.remote (issue 21) against the Ray Serve proxy, unchanged: a closure over a client tensor, two invokes
    sharing a future, per-step generation control and a session give what they give against one server."""
    import asyncinterp as ai
    direction = torch.randn(64, generator=torch.Generator().manual_seed(3))
    boost_at = [0, 2]

    async def steer(m):
        h = await m.transformer.h[1].output
        h[:] = h + 4.0 * direction
        return (await m.lm_head.output)[:, -1].clone()

    async def steer_some_steps(m):
        seen = []
        async for step in m.steps():
            h = await m.transformer.h[0].output
            if step in boost_at:
                h[:] = h + 2.0 * direction
            seen.append(step)
        return seen

    def everything(model):
        gen = model.generate(PROMPTS[0], steer_some_steps, max_new_tokens=4)
        return {"steer": model.trace(PROMPTS[0], steer), "patch": _patching(model)[0], "steps": gen.result,
                "tokens": gen.tokens, "session": model.session(patching_sweep, layers=(1, 0))}

    with ai.remote(dep.url, api_key=KEY) as through, ai.remote(dep.single.url, api_key=KEY) as one:
        got, want = everything(through), everything(one)
    assert got["steps"] == want["steps"] == [0, 1, 2, 3]
    assert torch.equal(got["tokens"], want["tokens"])
    for key in ("steer", "patch"):
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-5)
    for a, b in zip(got["session"], want["session"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- a replica killed under load
LOAD = 200
CONCURRENCY = 16
KILL_AFTER = 40


async def _load(dep, expected, victim_pids):
    """200 requests (registered `mark` with a visible effect, OpenAI completions, OpenAI streams); one replica
    is SIGKILLed after KILL_AFTER answers. Returns each request's outcome and the victim's id."""
    outcomes = {}
    sem = asyncio.Semaphore(CONCURRENCY)
    state = {"done": 0, "killed": None, "last": None}

    async def one(i, http, client):
        kind = ("mark", "completion", "stream")[i % 3]
        prompt = PROMPTS[i % len(PROMPTS)]
        async with sem:
            try:
                if kind == "mark":
                    try:
                        got = await client.trace(prompt, "mark", tag=i)
                        outcomes[i] = ("ok" if torch.equal(got, expected[("mark", prompt)]) else "WRONG", got)
                    except RemoteError as exc:
                        outcomes[i] = ("error", exc)
                elif kind == "completion":
                    r = await http.post(f"{dep.url}/v1/completions", json={"model": NAME, "prompt": prompt,
                                                                          "max_tokens": 6, "temperature": 0})
                    if r.status_code == 200:
                        state["last"] = r.headers[REPLICA]
                        ok = r.json()["choices"][0]["text"] == expected[("text", prompt)]
                        outcomes[i] = ("ok" if ok else "WRONG", r)
                    else:
                        outcomes[i] = ("error", r)
                else:
                    async with http.stream("POST", f"{dep.url}/v1/completions",
                                           json={"model": NAME, "prompt": prompt, "max_tokens": 6,
                                                 "temperature": 0, "stream": True}) as r:
                        body = (await r.aread()).decode()
                    events = [line[6:] for line in body.split("\n") if line.startswith("data: ")]
                    if r.status_code != 200:
                        outcomes[i] = ("error", r)
                    elif events[-1:] != ["[DONE]"]:
                        outcomes[i] = ("CUT SILENTLY", body)
                    elif any('"error"' in e for e in events[:-1]):
                        outcomes[i] = ("stream error", json.loads(events[-2])["error"])
                    else:
                        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
                        outcomes[i] = ("ok" if text == expected[("text", prompt)] else "WRONG", body)
            except httpx.HTTPError as exc:               # a connection dropped without an answer
                outcomes[i] = ("LOST", repr(exc))
            state["done"] += 1
            if state["done"] == KILL_AFTER:              # the replica that answered last: it holds requests now
                os.kill(victim_pids[state["last"]], signal.SIGKILL)
                state["killed"] = state["last"]

    async with httpx.AsyncClient(headers=headers(), timeout=120) as http, \
            AsyncClient(dep.url, api_key=KEY) as client:
        await asyncio.gather(*(one(i, http, client) for i in range(LOAD)))
    return outcomes, state["killed"]


def test_replica_killed_under_load_loses_nothing_silently_and_recovers(dep):
    one = Client(dep.single.url, api_key=KEY)
    one_oa = openai_client(dep.single.url)
    expected = {}
    for p in PROMPTS:
        expected[("mark", p)] = one.trace(p, "top_k", k=1)["ids"][..., 0]
        expected[("text", p)] = one_oa.completions.create(model=NAME, prompt=p, max_tokens=6,
                                                          temperature=0).choices[0].text
    before = replica_ids()
    pids = {rid: ray.get(replica_actor(rid).__ray_call__.remote(lambda self: os.getpid()), timeout=30)
            for rid in before}
    open(dep.marks, "w").close()
    t0 = time.monotonic()
    outcomes, victim = asyncio.run(_load(dep, expected, pids))
    took = time.monotonic() - t0
    kinds = collections.Counter(o[0] for o in outcomes.values())
    assert victim in before and set(kinds) <= {"ok", "error", "stream error"}, (kinds, [
        o for o in outcomes.values() if o[0] not in ("ok", "error", "stream error")][:3])
    assert len(outcomes) == LOAD
    # the requests the dead replica held fail clearly: a 502 saying what happened, or a stream's error event
    failed = [o for o in outcomes.values() if o[0] != "ok"]
    assert 1 <= len(failed) <= CONCURRENCY, kinds
    for kind, answer in failed:
        if isinstance(answer, RemoteError):            # the native endpoint, through the package's client
            assert answer.status == 502 and answer.kind == "replica_lost" and "not retried" in str(answer)
        elif kind == "error":
            assert answer.status_code == 502 and answer.headers["x-should-retry"] == "false", answer.text
            assert answer.json()["error"]["code"] == "replica_lost"
        else:
            assert answer["code"] == "replica_lost"
    # no request ran twice: every tag marked at most once, and every answered `mark` exactly once
    with open(dep.marks) as f:
        marks = collections.Counter(int(line) for line in f.read().split())
    assert not [t for t, n in marks.items() if n > 1]
    assert all(marks[i] == 1 for i, o in outcomes.items() if i % 3 == 0 and o[0] == "ok")
    # Ray brings a replica back; both answer again
    dep.wait_ready(timeout=90)
    after = replica_ids()
    assert victim not in after and len(after - before) == 1
    assert answered_by(dep.url, after) == after      # the new replica serves
    print(f"\n200 requests in {took:.1f} s with one replica killed: {dict(kinds)}")
