"""ai.remote (issue 21): the same functions, helpers and invokes run on a live server with the local results.

One uvicorn server (in a thread of this process, a free loopback port) serves
a tiny GPT-2 with --allow-code for the whole module; the local runs use a
second instance of the same model (same seed, same weights). Every remote
result is compared with the local one (1e-5).
"""

import asyncio
import math
import re
import time

import anyio
import httpx
import msgpack
import pytest
import torch

import asyncinterp as ai
from asyncinterp.kernel.errors import ModulePathError
from asyncinterp.models import tiny
from asyncinterp.serve import Server, wire
from asyncinterp.serve.jobs.job_wire import dumps_job
from asyncinterp.client.protocol import VersionMismatch, versions
from asyncinterp.client.wire import RemoteError
from remote_helpers import Live
from serve_helpers import one_thread  # noqa: F401 - fixture found by name

KEY = "remote-key"
LAYER = 1                          # a module-level constant the interventions read
PROMPT = "The Eiffel Tower is in the city of"


def scale_of(h):
    """A helper the interventions call (it reads a module and a constant)."""
    return h * 0.5 + math.sqrt(LAYER - 1.0)


@pytest.fixture(scope="module")
def local():
    return tiny("gpt2")


@pytest.fixture(scope="module")
def live(one_thread):
    served = tiny("gpt2")
    server = Server(served, api_keys=[KEY], allow_code=True, max_batch=8, max_wait_ms=30, code_budget=1.0,
                    max_body_bytes=1 << 20)

    @server.intervention("last_logits")
    async def last_logits(m, scale: float = 1.0):
        return (await m.lm_head.output)[:, -1] * scale

    live = Live(server)
    yield live
    live.close()


@pytest.fixture(scope="module")
def lm(live):
    model = ai.remote(live.url, api_key=KEY)
    yield model
    model.close()


def same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), type(b)
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (a, b)
        for x, y in zip(a, b):
            same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            same(a[k], b[k])
    else:
        assert a == b, (a, b)


# --------------------------------------------------------------------------- the table
def test_a_closure_over_a_client_tensor(local, lm):
    direction = torch.randn(64)

    async def steer(m):
        h = await m.transformer.h[1].output
        h[:] = h + 4.0 * direction
        return (await m.lm_head.output)[:, -1].clone()

    here = local.trace(PROMPT, steer)
    there = lm.trace(PROMPT, steer)
    same(here, there)

    async def plain(m):
        return (await m.lm_head.output)[:, -1].clone()
    assert not torch.allclose(there, local.trace(PROMPT, plain), atol=1e-3)   # the steering did something


def test_a_module_constant_and_a_helper(local, lm):
    async def scaled(m):
        h = await m.transformer.h[LAYER].output
        m.transformer.h[LAYER].output = scale_of(h)
        return (await m.lm_head.output)[:, -1].clone()

    same(local.trace(PROMPT, scaled), lm.trace(PROMPT, scaled))


def _patching(model):
    clean = ai.Future()

    async def record(m):
        clean.set_result((await m.transformer.h[1].output).clone())

    async def patch(m):
        h = await m.transformer.h[1].output
        h[:, -1] = (await clean)[:, -1]
        return (await m.lm_head.output)[:, -1].softmax(-1)

    with model.trace() as tr:
        tr.invoke("The Eiffel Tower is in the city of", record)
        p = tr.invoke("The Colosseum is in the city of", patch)
    return p.result, tr


def test_two_invokes_sharing_a_future_activation_patching(local, lm):
    here, _ = _patching(local)
    there, tr = _patching(lm)
    same(here, there)
    assert tr.invokes[0].result is None


def test_the_starlette_app_alone_answers_jobs_as_the_served_app_does(local, live):
    """``server.asgi`` (what the CLI and ``Server.run`` serve) answers ``POST /v1/jobs`` before Starlette's
    middleware and router; ``server.app`` (the Starlette app, for those who mount it themselves) through them:
    the same answers, the same errors."""
    plain = Live(None, app=live.server.app, lifespan="off")   # (its shutdown must not close the shared server)
    try:
        for url in (live.url, plain.url):
            with ai.remote(url, api_key=KEY) as there:
                same(_patching(local)[0], _patching(there)[0])
        answers = []
        for url in (live.url, plain.url):
            wrong = httpx.post(f"{url}/v1/jobs", content=b"\x80", headers={"authorization": "Bearer wrong"})
            bad = httpx.post(f"{url}/v1/jobs", content=b"\xc1", headers={"authorization": f"Bearer {KEY}"})
            get = httpx.get(f"{url}/v1/jobs", headers={"authorization": f"Bearer {KEY}"})
            answers.append([(r.status_code, r.content) for r in (wrong, bad, get)])
        assert answers[0] == answers[1]
        assert [status for status, _ in answers[0]][:2] == [401, 400]
    finally:
        plain.uv.should_exit = True
        plain.thread.join(15)


def test_generation_with_per_step_control_and_a_closure_over_a_list(local, lm):
    boost_at = [0, 2, 3]
    direction = torch.randn(64)

    async def steer_some_steps(m):
        seen = []
        async for step in m.steps():
            h = await m.transformer.h[0].output
            if step in boost_at:
                h[:] = h + 2.0 * direction
            seen.append(step)
        return seen

    here = local.generate(PROMPT, steer_some_steps, max_new_tokens=5)
    there = lm.generate(PROMPT, steer_some_steps, max_new_tokens=5)
    assert there.result == here.result == [0, 1, 2, 3, 4]
    assert there.text == here.text
    same(here.tokens, there.tokens)


def test_a_closure_over_a_file_handle_is_a_clear_client_type_error(lm, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello\n")
    with open(path) as handle:
        async def reads(m):
            handle.readline()
            return await m.lm_head.output

        with pytest.raises(TypeError, match="handle"):
            lm.trace(PROMPT, reads)


# --------------------------------------------------------------------------- the client's checks
def test_a_wrong_module_name_gets_did_you_mean_on_the_client(lm, live):
    async def typo(m):
        return await m.transformer.hh[0].output

    before = live.server.batcher.stats["requests"]
    with pytest.raises(ModulePathError, match="Did you mean 'h'"):
        lm.trace(PROMPT, typo)

    async def out_of_range(m):
        return await m.transformer.h[7].output

    with pytest.raises(ModulePathError, match="out of range"):
        lm.trace(PROMPT, out_of_range)
    assert live.server.batcher.stats["requests"] == before   # nothing was sent


def test_an_index_from_a_closure_is_checked_with_its_value_at_each_call(lm, live):
    def reader(layer):
        async def read(m):
            return (await m.transformer.h[layer].output)[:, -1].clone()
        return read

    assert lm.trace(PROMPT, reader(1)).shape[-1] > 0      # the same code object: its chains read once ...
    with pytest.raises(ModulePathError, match="index 9 is out of range"):
        lm.trace(PROMPT, reader(9))                         # ... the index it reads, every time
    assert lm.trace(PROMPT, reader(-1)).shape[-1] > 0


def test_a_version_mismatch_is_a_clear_error_naming_both(live):
    old = ai.remote(live.url, api_key=KEY)
    old.versions = {**versions(), "asyncinterp": "0.0.1"}

    async def read(m):
        return await m.lm_head.output

    with pytest.raises(VersionMismatch, match="0.0.1") as info:
        old.trace(PROMPT, read)
    assert versions()["asyncinterp"] in str(info.value) and versions()["python"] in str(info.value)
    old.close()

    # a client that does not check: the server refuses with both versions named
    job = ai.wrap(torch.nn.Linear(2, 2)).trace()
    job.invoke(torch.randn(1, 2), read)
    body = wire.packb({**versions(), "asyncinterp": "9.3.0", "python": "3.8.1", "job": dumps_job(job.job)})
    r = httpx.post(f"{live.url}/v1/jobs", content=body, headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 400
    error = wire.unpackb(r.content)["error"]
    assert error["type"] == "VersionMismatch" and "9.3.0" in error["message"] and "3.8.1" in error["message"]
    assert versions()["asyncinterp"] in error["message"]


# --------------------------------------------------------------------------- surface
def test_errors_on_error_and_registered_interventions(local, lm):
    async def fails(m):
        await m.transformer.h[0].output
        raise ValueError("no good")

    async def fine(m):
        return (await m.lm_head.output)[:, -1].clone()

    with pytest.raises(ValueError, match="no good"):
        lm.trace(PROMPT, fails)
    with lm.trace(on_error="continue") as tr:
        bad = tr.invoke(PROMPT, fails)
        good = tr.invoke("A dog ran into a", fine)
    with pytest.raises(RemoteError, match="no good"):
        bad.result
    same(local.trace("A dog ran into a", fine), good.result)

    top = lm.trace(PROMPT, lm.registered("last_logits", scale=2.0))
    same(local.trace(PROMPT, fine) * 2.0, top)


def test_atrace_under_asyncio_and_trio(local, lm):
    async def fine(m):
        return (await m.transformer.h[1].output).clone()

    expected = local.trace(PROMPT, fine)

    async def main():
        return await lm.atrace(PROMPT, fine)

    same(expected, anyio.run(main, backend="asyncio"))
    same(expected, anyio.run(main, backend="trio"))

    async def several():
        return await asyncio.gather(*(lm.atrace(PROMPT, fine) for _ in range(3)))
    for got in asyncio.run(several()):
        same(expected, got)


def test_streaming_a_remote_generation(lm):
    async def emits(m):
        async for step in m.steps():
            h = await m.transformer.h[0].output
            ai.serve.emit(float(h.float().norm()))

    events = list(lm.stream(PROMPT, emits, max_new_tokens=4))
    kinds = [e["event"] for e in events]
    assert kinds.count("token") == 4 and kinds.count("emit") == 4 and kinds[-1] == "done"
    assert kinds.index("emit") < kinds.index("done")
    assert events[-1]["result"].text == "".join(e["text"] for e in events if e["event"] == "token")

    async def main():
        return [e async for e in lm.astream(PROMPT, emits, max_new_tokens=3)]
    for backend in ("asyncio", "trio"):
        got = anyio.run(main, backend=backend)
        assert [e["event"] for e in got].count("token") == 3 and got[-1]["event"] == "done"
        assert [e["value"] for e in got if e["event"] == "emit"] == \
            [e["value"] for e in events if e["event"] == "emit"][:3]


# --------------------------------------------------------------------------- the whole job is one request
def test_a_group_is_never_split_across_batches(local, live, lm):
    """Groups of 3 and single requests arrive together; max_batch=8 takes whole groups only, and each
    group's invokes share a future (which would be unset if its invokes ran in different forwards)."""
    batcher = live.server.batcher
    sizes = []
    execute = batcher._execute

    def recording(batch):
        sizes.append([getattr(r, "size", 1) for r in batch])
        return execute(batch)

    async def single(m):
        return (await m.lm_head.output)[:, -1].clone()

    def one_group():
        hand = ai.Future()

        async def source(m):
            h = (await m.transformer.h[0].output).clone()
            hand.set_result(h[:, -1])
            return h[:, -1]

        async def sink(m):
            h = await m.transformer.h[0].output
            return (await hand) + 0 * h[:, -1]

        tr = lm.trace()
        tr.invoke(PROMPT, source)
        tr.invoke("A dog ran into a", sink)
        tr.invoke("Once upon a time there", sink)
        return tr

    batcher._execute = recording
    try:
        runs = [one_group() for _ in range(3)]

        async def main():
            async with anyio.create_task_group() as tg:
                for tr in runs:
                    tg.start_soon(tr.arun)
                for _ in range(3):
                    tg.start_soon(lm.atrace, PROMPT, single)
        anyio.run(main)
    finally:
        batcher._execute = execute
    assert sum(sum(s) for s in sizes) == 3 * 3 + 3
    assert all(sum(s) <= batcher.max_batch for s in sizes), sizes
    assert sum(s.count(3) for s in sizes) == 3          # every group went into a batch whole
    for tr in runs:
        first, second, third = (inv.result for inv in tr.invokes)
        same(first, second)
        same(first, third)


def test_a_jobs_budget_counts_all_of_its_invokes(live):
    """Three invokes that never stop: the job is cut once, after about one budget in all (not three)."""
    from serve_helpers import SPIN
    ns = {}
    exec(compile(SPIN, "spin", "exec"), ns)  # noqa: S102 - a test's own source, for its code object only
    lines = SPIN.splitlines(True)

    import linecache
    linecache.cache["<remote-spin>"] = (len(SPIN), None, lines, "<remote-spin>")
    exec(compile(SPIN, "<remote-spin>", "exec"), ns)  # noqa: S102
    spin = ns["f"]
    model = ai.remote(live.url, api_key=KEY)
    with model.trace(on_error="continue") as tr:
        for _ in range(3):
            tr.invoke(PROMPT, spin)
    model.close()
    messages = set()
    for inv in tr.invokes:
        with pytest.raises(RemoteError, match="compute budget of 1 s") as info:
            inv.result
        messages.add(info.value.message)
    assert len(messages) == 1, messages          # one cut for the job, when its invokes together used 1 s
    used = float(re.search(r"ran in hook firings: ([0-9.]+) s", messages.pop()).group(1))
    assert 1.0 <= used < 1.5, used


# --------------------------------------------------------------------------- forged messages
def _job_bytes(fn, *values):
    tr = ai.wrap(torch.nn.Linear(2, 2)).trace()
    tr.invoke(PROMPT, fn)
    return wire.unpackb(dumps_job(tr.job))


def _post(live, body):
    r = httpx.post(f"{live.url}/v1/jobs", content=wire.packb(body), headers={"authorization": f"Bearer {KEY}"})
    return r.status_code, wire.unpackb(r.content, wire.answer_limits(len(r.content)))


def _send(live, job):
    return _post(live, {**versions(), "job": wire.packb(job)})


async def honest(m):
    return (await m.lm_head.output)[:, -1].clone()


def test_forged_jobs_are_refused(live):
    job = _job_bytes(honest)
    status, answer = _send(live, job)
    assert status == 200 and answer["results"][0]["ok"]

    tampered = wire.unpackb(wire.packb(job))
    tampered["capture"]["functions"][0]["source"] = \
        "async def honest(m):\n    import os\n    return os.listdir('/')\n"
    status, answer = _send(live, tampered)
    assert status == 400 and "os" in answer["error"]["message"], answer

    not_a_function = wire.unpackb(wire.packb(job))
    not_a_function["capture"]["functions"][0]["source"] = "honest = print\n"
    status, answer = _send(live, not_a_function)
    assert status == 400 and "not one plain" in answer["error"]["message"], answer

    deep = wire.unpackb(wire.packb(job))
    value = ["=", 1]
    for _ in range(40):
        value = ["L", [value]]
    deep["capture"]["functions"][0]["values"]["DEEP"] = value
    status, answer = _post(live, {**versions(), "job": msgpack.packb(deep)})   # (our wire would not write it)
    assert status == 400 and "nest" in answer["error"]["message"], answer

    status, answer = _post(live, {**versions(), "job": b"\x93\x01\x02"})
    assert status == 400


def test_a_huge_captured_tensor_is_413(lm):
    big = torch.zeros(400_000)          # 1.6 MB > the server's 1 MiB body limit

    async def uses_big(m):
        h = await m.lm_head.output
        return h[:, -1] + big[:1]

    with pytest.raises(RemoteError) as info:
        lm.trace(PROMPT, uses_big)
    assert info.value.status == 413


def test_captured_values_cannot_reach_another_tenant(live):
    """Two tenants send the same function with different captured values in one batch: each gets its own;
    one tenant's in-place change of its captured tensor reaches neither the other nor its own next job."""
    a = ai.remote(live.url, api_key=KEY)
    b = ai.remote(live.url, api_key=KEY)

    def make(secret):
        async def tenant(m):
            await m.lm_head.output
            out = secret.clone()
            secret.add_(100.0)          # changes only this job's private copy
            return out
        return tenant

    secret_a, secret_b = torch.full((3,), 1.0), torch.full((3,), 2.0)

    async def main():
        out = {}

        async def one(model, key, fn):
            out[key] = await model.atrace(PROMPT, fn)
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, a, "a", make(secret_a))
            tg.start_soon(one, b, "b", make(secret_b))
        return out

    out = anyio.run(main)
    same(out["a"], torch.full((3,), 1.0))
    same(out["b"], torch.full((3,), 2.0))
    same(a.trace(PROMPT, make(secret_a)), torch.full((3,), 1.0))   # the server kept nothing
    same(secret_a, torch.full((3,), 1.0))                            # nor changed the client's tensor
    a.close()
    b.close()


# --------------------------------------------------------------------------- gradients (docs/remote.md)
def test_gradients_run_remotely_as_locally(lm, local):
    """Saliency of a hidden state (torch.autograd.grad), a backward from the loss to a .grad point, and
    attribution patching (two invokes, a future, one backward): remote equals local."""
    async def saliency(m):
        h = await m.transformer.h[LAYER].output
        logits = await m.lm_head.output
        (g,) = torch.autograd.grad(logits[:, -1].max(), h)
        return g.norm(dim=-1)

    same(lm.trace(PROMPT, saliency), local.trace(PROMPT, saliency))

    async def through_backward(m):
        await m.transformer.h[0].output
        grad = await ai.spawn(m.transformer.h[0].output.grad)     # resumed during the backward below
        loss = (await m.lm_head.output)[:, -1].logsumexp(-1).sum()
        await m.backward(loss)
        return (await grad).abs().sum(-1)

    same(lm.trace(PROMPT, through_backward), local.trace(PROMPT, through_backward))

    def attribution_patching(model):
        clean = ai.Future()

        async def record(m):
            clean.set_result((await m.transformer.h[LAYER].output)[:, -1].detach().clone())

        async def attribute(m):
            h = await m.transformer.h[LAYER].output
            grad = await ai.spawn(m.transformer.h[LAYER].output.grad)
            logits = await m.lm_head.output
            await m.backward(logits[:, -1].log_softmax(-1)[:, 0].sum())
            return ((await clean) - h[:, -1].detach()).mul((await grad)[:, -1]).sum(-1)

        with model.trace() as tr:
            tr.invoke(PROMPT, record)
            b = tr.invoke("The Colosseum is in the city of", attribute)
        return b.result

    same(attribution_patching(lm), attribution_patching(local))


# --------------------------------------------------------------------------- sessions
async def patching_sweep(model, layers=(0, 1)):
    """A session: a clean run, then one patched run per layer, the clean activations flowing between them."""
    async def record(m):
        return [(await m.transformer.h[i].output)[:, -1].clone() for i in range(len(m.transformer.h))]

    clean = await model.atrace(PROMPT, record)
    out = []
    for layer in layers:
        async def patch(m, layer=layer):
            h = await m.transformer.h[layer].output
            h[:, -1] = clean[layer]
            return (await m.lm_head.output)[:, -1].softmax(-1).max()
        out.append(await model.atrace("The Colosseum is in the city of", patch))
    return out


def test_a_session_runs_remotely_as_locally(local, lm):
    expected = asyncio.run(patching_sweep(local, layers=(1, 0)))
    same(expected, lm.session(patching_sweep, layers=(1, 0)))          # one request

    async def main():
        return await lm.asession(patching_sweep, layers=(1, 0))
    for backend in ("asyncio", "trio"):
        same(expected, anyio.run(main, backend=backend))

    with pytest.raises(TypeError, match="a remote session is a function"):
        lm.session()


def test_a_session_error_keeps_its_type_and_line(lm):
    async def bad(model):
        async def read(m):
            return await m.transformer.h[0].output
        await model.atrace(PROMPT, read)
        raise ValueError("no luck")

    with pytest.raises(ValueError, match="no luck") as info:
        lm.session(bad)
    assert isinstance(info.value, RemoteError)
    with pytest.raises(TypeError, match="cannot travel"):
        handle = open(__file__)
        try:
            async def uses_file(model):
                return handle.read()
            lm.session(uses_file)
        finally:
            handle.close()


# --------------------------------------------------------------------------- docs/remote.md's "cannot run remotely"
def test_what_cannot_run_remotely_fails_clearly(lm):
    from asyncinterp.kernel.errors import ReplacementError

    with pytest.raises(TypeError, match="a cache filter function cannot travel"):
        ai.cache(lm, PROMPT, lambda path, module: path.endswith("mlp"))

    window = ai.Cache("transformer.h.*", start=False)

    async def switch(m):
        await m.transformer.h[0].output
        window.start()

    with pytest.raises(TypeError, match="window.*Cache, which cannot travel"):
        lm.trace(PROMPT, window, switch)

    async def ban(m):
        logits = await m.lm_head.output
        logits[:, :, 0] = -float("inf")

    with pytest.raises(ReplacementError, match="inf or nan"):
        lm.trace(PROMPT, ban)
    with pytest.raises(ValueError, match="inf or nan"):
        lm.trace(PROMPT, ban)

    with pytest.raises(TypeError, match="lambda"):
        lm.trace(PROMPT, lambda m: m.lm_head.output)
    with pytest.raises(NotImplementedError, match="persistent edits"):
        lm.edit(ban)
    with pytest.raises(TypeError, match="not the model's output"):
        lm.trace(PROMPT)

    async def last(m):
        return (await m.lm_head.output)[:, -1].clone()

    with pytest.raises(ValueError, match="output_attentions"):
        lm.trace(PROMPT, last, output_attentions=True)

    async def tokenizer(m):
        await m.lm_head.output
        return lm.tokenizer.decode([1])     # the model travels by reference; its tokenizer does not

    with pytest.raises(AttributeError, match="tokenizer"):
        lm.trace(PROMPT, tokenizer)

    async def returns_a_point(m):
        return m.lm_head.output

    with pytest.raises(TypeError):
        lm.trace(PROMPT, returns_a_point)


def test_a_remote_cache_fills_the_users_cache(local, lm):
    here = ai.cache(local, PROMPT, "transformer.h.*")
    there = ai.cache(lm, PROMPT, "transformer.h.*")
    assert there.keys() == here.keys() == ["transformer.h.0.output", "transformer.h.1.output"]
    for key in here.keys():
        same(here[key], there[key])


def test_the_model_travels_by_reference(local, lm):
    """An intervention reading the model (or a module of it) from its scope gets the served model there."""
    def reader(model):
        layers = model.transformer.h

        async def read(m):
            token = (await layers[-1].output)[:, -1].sum() * 0 + 3
            return (await m.lm_head.output)[:, -1].clone(), model.decode([int(token)])
        return read

    here = local.trace(PROMPT, reader(local))
    same(here, lm.trace(PROMPT, reader(local)))    # the local model's envoys stand for the served model's

    async def decodes(m):
        ids = (await m.lm_head.output)[0, -3:].argmax(-1)
        return lm.decode(ids)                       # `lm` is the remote model: the served model's decode

    async def decodes_here(m):
        ids = (await m.lm_head.output)[0, -3:].argmax(-1)
        return local.decode(ids)
    assert lm.trace(PROMPT, decodes) == local.trace(PROMPT, decodes_here)


def test_a_job_larger_than_max_batch_is_413(lm):
    async def last(m):
        return (await m.lm_head.output)[:, -1].clone()

    with pytest.raises(RemoteError, match="max_batch=8") as info:
        with lm.trace() as tr:
            for _ in range(9):
                tr.invoke(PROMPT, last)
    assert info.value.status == 413


def test_a_server_without_allow_code_takes_registered_interventions_only(local):
    server = Server(tiny("gpt2"), allow_code=False)

    @server.intervention("last_logits")
    async def last_logits(m, scale: float = 1.0):
        return (await m.lm_head.output)[:, -1] * scale

    live = Live(server)
    try:
        lm = ai.remote(live.url)

        async def mine(m):
            return (await m.lm_head.output)[:, -1].clone()

        with pytest.raises(RemoteError, match="--allow-code") as info:
            lm.trace(PROMPT, mine)
        assert info.value.status == 400
        with lm.trace() as tr:   # registered ones, several in one job
            a = tr.invoke(PROMPT, lm.registered("last_logits"))
            b = tr.invoke("A dog ran into a", lm.registered("last_logits", scale=3.0))
        same(a.result, local.trace(PROMPT, mine))
        same(b.result, local.trace("A dog ran into a", mine) * 3.0)
        lm.close()
    finally:
        live.close()


def test_jobs_under_process_isolation(local):
    """The default of `asyncinterp serve --allow-code`: the model runs in supervised worker processes; a job is
    checked by the server, rebuilt and run whole in the code worker, and gives the local results."""
    from asyncinterp.serve.workers.supervisor import ProcessIsolation
    server = Server(tiny("gpt2"), allow_code=True, isolation=ProcessIsolation(), max_batch=8, code_budget=5.0)
    live = Live(server)
    try:
        lm = ai.remote(live.url)
        here, _ = _patching(local)
        there, _ = _patching(lm)
        same(here, there)

        async def steps(m):
            out = []
            async for step in m.steps():
                out.append(float((await m.transformer.h[0].output).float().norm()))
                ai.serve.emit(step)
            return out
        g_here = local.generate(PROMPT, steps, max_new_tokens=3)
        g_there = lm.generate(PROMPT, steps, max_new_tokens=3)
        same(g_here.result, g_there.result)
        assert g_here.text == g_there.text
        events = list(lm.stream(PROMPT, steps, max_new_tokens=3))
        assert [e["value"] for e in events if e["event"] == "emit"] == [0, 1, 2]
        lm.close()
    finally:
        live.close()


def test_m_stop_in_a_remote_generation_keeps_what_a_local_one_keeps(local, lm):
    async def stop_at_tokens(m):
        async for step in m.steps():
            await m.tokens
            if step == 1:
                m.stop()
                return step

    async def stop_at_a_layer(m):
        async for step in m.steps():
            await m.transformer.h[0].output
            if step == 1:
                m.stop()
                return step

    for fn in (stop_at_tokens, stop_at_a_layer):
        here = local.generate(PROMPT, fn, max_new_tokens=5)
        there = lm.generate(PROMPT, fn, max_new_tokens=5)
        assert there.result == here.result == 1
        same(here.tokens, there.tokens)
        assert len(there.tokens) == (2 if fn is stop_at_tokens else 1)
