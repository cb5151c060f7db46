"""Tenants stay apart on the job surface, attacked through a real server (uvicorn on 127.0.0.1).

Each attack runs beside a victim request of another key that shares the server (and, where the batcher
would put them together, the forward); the victim's answer is compared bit for bit with its solo run.
One test per class of docs/serving.md's "Tenants" guarantees: rows, randomness, hooks, source names,
bounded work before the sandbox (line caches, references, rows), and the checks of generation options
and of what errors echo.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time

import httpx
import pytest
import torch

import asyncinterp as ai
from asyncinterp.serve import Client, RemoteError, Server, wire
from asyncinterp.serve.jobs.job_wire import dumps_job
from asyncinterp.serve.sandbox.rebuild import MAX_FUNCTIONS
from remote_helpers import Live
from serve_helpers import model, one_thread  # noqa: F401 - fixtures are found by name

VICTIM, ATTACKER = "victim-key", "attacker-key"
SECRET_PROMPT = "my password is hunter2"
ATTACK_PROMPT = "the weather is really nice"        # the same token count as SECRET_PROMPT (exact=True batches them)


async def last(m):
    return (await m.lm_head.output)[:, -1].clone()


@pytest.fixture(scope="module")
def code_server(model):
    server = Server(model, api_keys=[VICTIM, ATTACKER], allow_code=True, exact=True, max_batch=8,
                    max_wait_ms=150, timeout=30, code_budget=5.0, max_body_bytes=4 << 20)
    server.intervention("last")(last)
    live = Live(server)
    yield live
    live.close()


@pytest.fixture(scope="module")
def plain_server(model):
    """No --allow-code: only registered interventions (the built-ins ``read``, ``ablate``, ...)."""
    live = Live(Server(model, api_keys=[VICTIM, ATTACKER], exact=True, max_batch=8, max_wait_ms=150, timeout=30))
    yield live
    live.close()


def rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def together(*calls):
    """Start every call at once (threads); their outcomes (a value or the exception), in order."""
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(c) for c in calls]
        out = []
        for f in futures:
            try:
                out.append(f.result(timeout=120))
            except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
                out.append(exc)
        return out


def post_job(live, body: dict, key=ATTACKER):
    return httpx.post(f"{live.url}/v1/jobs", content=wire.packb(body), timeout=60,
                      headers={"content-type": "application/msgpack", "authorization": f"Bearer {key}"})


def job_body(job_bytes: bytes) -> dict:
    from asyncinterp.client.protocol import versions
    return {**versions(), "job": job_bytes}


# ----------------------------------------------------------------------------------- 1. rows
def test_an_input_less_invoke_sees_only_its_own_jobs_rows(model, code_server):
    solo = model.trace(SECRET_PROMPT, last)

    async def noop(m):
        await m.transformer.h[0].output

    async def spy(m):                      # no input: "the whole batch"
        h = await m.transformer.h[0].output
        h.mul_(-3.0)                       # an in-place edit of every row it sees
        return h.shape[0]

    def attack():
        remote = ai.remote(code_server.url, api_key=ATTACKER)
        try:
            with remote.trace() as run:
                run.invoke(ATTACK_PROMPT, noop)
                rows = run.invoke(spy)
            return rows.result
        finally:
            remote.close()

    def victim():
        with Client(code_server.url, api_key=VICTIM, timeout=60) as c:
            return c.trace(SECRET_PROMPT, "last")

    for _ in range(3):
        rows, seen = together(attack, victim)
        assert rows == 1, rows                          # the job's own row, never the victim's
        assert torch.equal(seen, solo)                  # the victim is untouched, bit for bit


def test_a_registered_intervention_without_input_cannot_reach_a_plain_generation(model, plain_server):
    solo = model.generate(SECRET_PROMPT, max_new_tokens=6).tokens.tolist()

    def attack():
        remote = ai.remote(plain_server.url, api_key=ATTACKER)
        try:
            with remote.generate(max_new_tokens=6) as run:
                run.invoke(ATTACK_PROMPT)
                run.invoke(remote.registered("ablate", module="transformer.h.1"))
            return "ran"
        finally:
            remote.close()

    def victim():
        with Client(plain_server.url, api_key=VICTIM, timeout=60) as c:
            return c.generate(SECRET_PROMPT, max_new_tokens=6).tokens

    for _ in range(3):
        outcome, tokens = together(attack, victim)
        assert not isinstance(outcome, Exception), outcome
        assert tokens == solo


# ----------------------------------------------------------------------------------- 2. randomness
def test_a_seed_means_the_same_tokens_whoever_shares_the_batch(model, code_server):
    options = dict(max_new_tokens=8, do_sample=True, seed=1234, temperature=1.5)
    solo = model.generate(SECRET_PROMPT, **options).tokens.tolist()

    async def hostile(m):
        async for _ in m.steps():
            await m.transformer.h[0].output
            torch.rand(1000)              # draws from torch's generator, between the victim's draws

    def attack():
        remote = ai.remote(code_server.url, api_key=ATTACKER)
        try:
            return remote.generate(ATTACK_PROMPT, hostile, **options)
        finally:
            remote.close()

    def victim():
        remote = ai.remote(code_server.url, api_key=VICTIM)
        try:
            return remote.generate(SECRET_PROMPT, **options).tokens.tolist()
        finally:
            remote.close()

    before = code_server.server.batcher.stats["batches"]
    for _ in range(3):
        outcome, *tokens = together(attack, victim, victim)
        assert not isinstance(outcome, Exception), outcome
        assert tokens == [solo, solo]
    # they did share forwards: fewer batches than requests
    assert code_server.server.batcher.stats["batches"] - before < 9


# ----------------------------------------------------------------------------------- 3. hooks
async def call_kept_envoys(model):
    """A session keeps an envoy from one trace and calls its module outside any run, again and again."""
    kept = []

    async def grab(m):
        kept.append(m.lm_head)
        return 0

    await model.atrace("hello there", grab)
    x = torch.randn(1, 5, 64) * 100
    for _ in range(40):
        for _ in range(20):
            kept[0](x)
        await model.atrace("hello there", grab)     # yields to the event loop
    return "done"


def test_a_module_called_outside_a_run_never_reaches_another_runs_hooks(model, code_server):
    solo = model.trace(SECRET_PROMPT, last)

    def session():
        remote = ai.remote(code_server.url, api_key=ATTACKER)
        try:
            return remote.session(call_kept_envoys)
        finally:
            remote.close()

    def victims():
        out = []
        with Client(code_server.url, api_key=VICTIM, timeout=60) as c:
            for _ in range(25):
                out.append(c.trace(SECRET_PROMPT, "last"))
        return out

    outcome, seen = together(session, victims)
    assert outcome == "done", outcome
    for value in seen:
        assert torch.equal(value, solo)


# ----------------------------------------------------------------------------------- 4. source names
VICTIM_SOURCE = '''
async def steer(m):
    api_key = 'sk-VICTIM-SECRET-42'
    return (await m.lm_head.output)[:, -1].clone()
'''
ATTACK_SOURCE = '''
async def steer(m):
    await m.lm_head.output; spin()
    return 1 // 0
'''


def _job_of_source(model, source, prompt, **names):
    """The wire bytes of a job whose intervention ``steer`` comes from ``source`` in a file named notebook.py."""
    import linecache
    linecache.cache["notebook.py"] = (len(source), None, source.splitlines(True), "notebook.py")
    try:
        space = dict(names)
        exec(compile(source, "notebook.py", "exec"), space)   # the same name and file for both tenants
        return _job_bytes(model, space["steer"], prompt)
    finally:
        linecache.cache.pop("notebook.py", None)


def _spin():
    n = 0
    for k in range(300000):
        n += k
    return n


def test_a_traceback_never_shows_another_tenants_source(model, code_server):
    victim_job = job_body(_job_of_source(model, VICTIM_SOURCE, SECRET_PROMPT))
    attack_job = job_body(_job_of_source(model, ATTACK_SOURCE, ATTACK_PROMPT, spin=_spin))

    def attack():
        r = post_job(code_server, attack_job)
        assert r.status_code == 200, r.content[:300]
        error = wire.unpackb(r.content)["results"][0]["error"]
        return "\n".join([error["message"], *error["traceback"], *error["notes"]])

    def victims():
        for _ in range(6):
            time.sleep(0.05)
            assert post_job(code_server, victim_job, key=VICTIM).status_code == 200

    text, _ = together(attack, victims)
    assert "ZeroDivisionError" in text or "division" in text, text
    assert "1 // 0" in text, text              # its own line, from its own source
    assert "VICTIM" not in text


# ----------------------------------------------------------------------------------- 5. line caches
def _job_bytes(model, fn, prompt=ATTACK_PROMPT):
    """A job's wire bytes, built on the local model (what ai.remote would send)."""
    trace = model.trace()
    trace.invoke(prompt, fn)
    return dumps_job(trace.job)


def test_refused_and_oversized_jobs_keep_the_main_process_flat(model, code_server):
    async def f(m):
        return (await m.lm_head.output)[:, -1]

    base = wire.unpackb(_job_bytes(model, f))

    def with_functions(mutate):
        body = {**base, "capture": {**base["capture"]}}
        body["capture"]["functions"] = mutate([dict(e) for e in base["capture"]["functions"]])
        return job_body(wire.packb(body))

    far = with_functions(lambda fs: [{**fs[0], "line": 999_999}])                      # padding bomb
    many = with_functions(lambda fs: [{**fs[0], "name": f"f{i}", "source": fs[0]["source"].replace(
        "def f(", f"def f{i}(", 1)} for i in range(MAX_FUNCTIONS + 1)])                 # too many functions
    bad = with_functions(lambda fs: [{**fs[0], "source": fs[0]["source"] + "\nimport os\n"}])   # refused code
    for body in (far, many, bad):
        r = post_job(code_server, body)
        assert r.status_code in (400, 413), r.status_code
    assert post_job(code_server, many).status_code == 413
    assert "captured functions" in wire.unpackb(post_job(code_server, many).content)["error"]["message"]
    headers = {"content-type": "application/msgpack", "authorization": f"Bearer {ATTACKER}"}
    bodies = [wire.packb(b) for b in (far, many, bad)]
    with httpx.Client(timeout=60, headers=headers) as client:
        for i in range(150):     # warm-up: the allocator's arenas settle (it plateaus after this)
            client.post(f"{code_server.url}/v1/jobs", content=bodies[i % 3])
        start = rss_mib()
        for i in range(1000):
            r = client.post(f"{code_server.url}/v1/jobs", content=bodies[i % 3])
            assert r.status_code in (400, 413)
    # before: 30 refused 300-byte jobs kept 220 MiB (padded source cached before the size check, never evicted)
    assert rss_mib() - start < 40, (start, rss_mib())


def test_health_stays_fast_while_a_large_job_is_checked(model, code_server):
    async def f(m):
        return (await m.lm_head.output)[:, -1]

    base = wire.unpackb(_job_bytes(model, f))
    filler = "\n".join(f"    x{j} = {j} + {j}" for j in range(45))
    functions = [{**base["capture"]["functions"][0], "name": f"f{i}", "source": base["capture"]["functions"][0][
        "source"].replace("async def f(m):\n", f"async def f{i}(m):\n{filler}\n", 1)} for i in range(MAX_FUNCTIONS)]
    body = {**base, "capture": {**base["capture"], "functions": functions}}
    result = {}

    def send():
        result["r"] = post_job(code_server, job_body(wire.packb(body)))

    t = threading.Thread(target=send)
    t.start()
    slowest = 0.0
    while t.is_alive():
        t0 = time.monotonic()
        assert httpx.get(f"{code_server.url}/v1/health", timeout=10).status_code == 200
        slowest = max(slowest, time.monotonic() - t0)
        time.sleep(0.01)
    t.join()
    assert result["r"].status_code == 200, result["r"].content[:300]
    assert slowest < 1.0, slowest


# ----------------------------------------------------------------------------------- 6. references
def test_a_reference_is_a_reference_not_a_copy_per_use(model, code_server):
    big = torch.randn(128 * 1024)           # 512 KiB

    async def f(m):
        return (await m.lm_head.output)[:, -1].sum() * 0 + len(refs)

    refs = [big] * 2000
    body = job_body(_job_bytes(model, f))
    start = rss_mib()
    for _ in range(3):
        r = post_job(code_server, body)
        assert r.status_code == 200, r.content[:300]
        assert float(wire.unpackb(r.content)["results"][0]["value"]) == 2000
    assert rss_mib() - start < 100, (start, rss_mib())     # was ~1,000 MiB per request


# ----------------------------------------------------------------------------------- 7. rows vs max_batch
def test_token_id_rows_count_against_max_batch(code_server):
    async def f(m):
        return (await m.lm_head.output).shape[0]

    remote = ai.remote(code_server.url, api_key=ATTACKER)
    try:
        with pytest.raises(RemoteError) as info:
            remote.trace(torch.ones(2000, 4, dtype=torch.long), f)
        assert info.value.status == 413 and "max_batch=8" in info.value.message
        with pytest.raises(RemoteError) as info:
            with remote.trace() as run:
                for _ in range(3):
                    run.invoke(torch.ones(3, 4, dtype=torch.long), f)
        assert info.value.status == 413 and "9 rows" in info.value.message
        assert remote.trace(torch.ones(8, 4, dtype=torch.long), f) == 8
    finally:
        remote.close()


# ----------------------------------------------------------------------------------- the smaller ones
@pytest.mark.parametrize("option, value", [("temperature", 0.0), ("temperature", float("inf")),
                                           ("top_p", float("nan")), ("top_p", 0.0), ("top_k", -2),
                                           ("seed", "1"), ("temperature", -1.0)])
def test_bad_generation_options_are_a_400_naming_the_field(code_server, option, value):
    remote = ai.remote(code_server.url, api_key=ATTACKER)
    try:
        with pytest.raises(RemoteError) as info:
            remote.generate(ATTACK_PROMPT, max_new_tokens=2, do_sample=True, **{option: value})
        assert info.value.status == 400, info.value
        assert option in info.value.message
    finally:
        remote.close()


def test_errors_echo_only_an_excerpt(code_server):
    huge = "x" * (1 << 20)
    remote = ai.remote(code_server.url, api_key=ATTACKER)
    try:
        with pytest.raises(RemoteError) as info:
            remote.trace(ATTACK_PROMPT, remote.registered("last", **{huge: 1}))
        assert len(info.value.message) < 3000
        with pytest.raises(RemoteError) as info:
            remote.generate(ATTACK_PROMPT, max_new_tokens=2, stop=[huge])
        assert info.value.status == 400 and len(info.value.message) < 3000
    finally:
        remote.close()
