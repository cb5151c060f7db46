"""Hostile submitted code against a real server (uvicorn on 127.0.0.1), one test per attack class.

Each attack is sent together with innocent requests (so they share a forward
when the attack gets that far); the attack is refused or contained, the
innocent answers are bit-equal to solo runs, and the server stays healthy.
"""

import asyncio
import logging
import socket
import time

import httpx
import pytest
import torch

from asyncinterp.serve import AsyncClient, Client, RemoteError
from test_serve_http import KEY, PROMPTS, Live, last, make_server
from serve_helpers import model, one_thread  # noqa: F401 - fixtures are found by name

INNOCENT = PROMPTS[1:4]


@pytest.fixture(scope="module")
def live(model):
    srv = Live(make_server(model, allow_code=True, exact=True, max_wait_ms=40, timeout=30, max_queue=256))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def solos(model):
    return {p: model.trace(p, last) for p in INNOCENT}, \
        {p: model.generate(p, max_new_tokens=4).tokens.tolist() for p in INNOCENT}


def _healthy(live):
    assert httpx.get(f"{live.url}/v1/health", timeout=10).json()["status"] == "ok"


def attack(live, solos, source, *, generate=False, params=None):
    """Send ``source`` with innocent requests at once; check the innocents; return the attack's outcome."""
    traces, gens = solos

    async def go():
        async with AsyncClient(live.url, api_key=KEY, timeout=60) as c:
            if generate:
                bad = c.generate(PROMPTS[0], source, max_new_tokens=4, params=params)
                good = [c.generate(p, max_new_tokens=4) for p in INNOCENT]
            else:
                bad = c.trace(PROMPTS[0], source, params=params)
                good = [c.trace(p, "last") for p in INNOCENT]
            return await asyncio.gather(bad, *good, return_exceptions=True)

    res = asyncio.run(go())
    for p, r in zip(INNOCENT, res[1:]):
        if generate:
            assert r.tokens == gens[p], p                   # bit-equal to its solo generation
        else:
            assert torch.equal(r, traces[p]), p             # bit-equal to its solo run
    _healthy(live)
    return res[0]


def refused_before_model_work(live, solos, source, match, **kw):
    before = live.server.batcher.stats["requests"]
    out = attack(live, solos, source, **kw)
    assert isinstance(out, RemoteError) and out.status == 400 and out.kind == "refused", out
    assert match in out.message, out.message
    assert "line" in out.message
    # only the innocent requests reached the model
    assert live.server.batcher.stats["requests"] - before == len(INNOCENT)
    return out


def refused_at_call(live, solos, source, match, **kw):
    out = attack(live, solos, source, **kw)
    assert isinstance(out, RemoteError) and out.status == 422, out
    assert match in out.message, out.message
    return out


HEAD = "import torch\nimport torch.nn.functional as F\nfrom asyncinterp import gather, spawn\n"


# --------------------------------------------------------------------------- 1. memory corruption, addresses
@pytest.mark.parametrize("body, match", [
    ("i = torch.tensor([[0, 10**6]])\n    s = torch.sparse_coo_tensor(i, torch.ones(2), (1, 64))\n    h.add_(s)",
     "'sparse_coo_tensor'"),
    ("h.add_(h.to_sparse())", "'to_sparse'"),
    ("h.index_add_(0, torch.tensor([0]), h.to_sparse_csr())", "'to_sparse_csr'"),
    ("return id(h)", "'id'"),
    ("return hash(f)", "'hash'"),
    ("return h.data_ptr()", "'data_ptr'"),
    ("return h.untyped_storage()", "'untyped_storage'"),
    ("h.set_(h[0])", "'set_'"),
    ("return h.data", "'data'"),
    ("return getattr(h, 'as_' + 'strided')((9,), (1,))", "'getattr'"),
    ("return h.__class__", "'__class__'"),
])
def test_memory_and_address_ops_refused_before_model_work(live, solos, body, match):
    src = HEAD + f"async def f(m):\n    h = await m.transformer.h[0].output\n    {body}\n"
    refused_before_model_work(live, solos, src, match)


@pytest.mark.parametrize("body, match", [
    ("h.index_add_(1, torch.tensor([10**6]), torch.ones(1, 1, 64))", "out of range"),
    ("return torch.take(h, torch.tensor([10**9]))", "out of range"),
    ("return h.gather(2, torch.full((1, 1, 1), 10**7))", "out of range"),
    ("h.scatter_(2, torch.full((1, 1, 1), -10**7), 1.0)", "out of range"),
])
def test_out_of_range_indices_are_refused(live, solos, body, match):
    src = HEAD + f"async def f(m):\n    h = await m.transformer.h[0].output\n    {body}\n"
    refused_at_call(live, solos, src, match)


@pytest.mark.parametrize("body", [
    "return str(f)", "return f'{f}'", "return '%s' % (f,)", "return repr([f])", "return str(m.transformer.h[0].output.__await__)",
])
def test_text_of_objects_does_not_show_addresses(live, solos, body):
    src = HEAD + f"async def f(m):\n    h = await m.transformer.h[0].output\n    {body}\n"
    out = attack(live, solos, src)
    assert isinstance(out, RemoteError) and out.status in (400, 422), out
    assert "0x7" not in out.message and "memory address" in out.message or "__await__" in out.message


def test_error_messages_and_results_hide_addresses(live, solos):
    src = HEAD + ("async def f(m):\n    h = await m.transformer.h[0].output\n    g = lambda: 0\n"
                  "    try:\n        {}[g]\n    except KeyError as e:\n        return [a for a in e.args if 0]\n"
                  "    return 1\n")
    attack(live, solos, src)
    src2 = HEAD + "async def f(m):\n    g = lambda: 0\n    return {}[g]\n"
    out = attack(live, solos, src2)
    assert isinstance(out, RemoteError) and out.type == "KeyError"
    assert "0x" not in out.message.replace("0x…", "")


# --------------------------------------------------------------------------- 2. shared memory, KV cache
def test_kv_cache_unreachable_through_gather_spawn_and_points(live, solos):
    src = HEAD + '''
async def f(m):
    seen = []
    async for step in m.steps():
        h = await spawn(m.transformer.h[1].output)
        out, = await gather(m.output)
        seen.append(out.past_key_values is None and out["past_key_values"] is None)
        out.logits.zero_()                        # a private copy: changes nothing for anyone
        if step == 0:
            got = await h
            got.fill_(1e30)
            seen.append(isinstance(got, torch.Tensor))
    return seen
'''
    out = attack(live, solos, src, generate=True)
    assert all(out.result) and len(out.result) == 5


def test_in_place_edits_on_gathered_values_do_not_reach_others(live, solos, model):
    src = HEAD + '''
async def f(m):
    a, b = await gather(m.transformer.h[0].output, m.transformer.h[1].output)
    a.fill_(1e30)
    b.mul_(0)
    return a.shape[0]
'''
    assert attack(live, solos, src) == 1


def test_ad_hoc_results_and_returned_objects_are_private(live, solos):
    src = HEAD + '''
async def f(m):
    h = await m.transformer.h[0].output
    r = m.transformer.h[1](h)
    parts = r if isinstance(r, tuple) else (r,)
    return [p is None or isinstance(p, torch.Tensor) for p in parts]
'''
    assert all(attack(live, solos, src))


def test_in_place_edit_is_written_back_for_the_own_rows_only(live, solos, model):
    src = HEAD + '''
async def f(m):
    h = await m.transformer.h[0].output
    h[:, -1] += 3.0
    return (await m.lm_head.output)[:, -1].clone()
'''

    async def local(m):
        h = await m.transformer.h[0].output
        h[:, -1] += 3.0
        return (await m.lm_head.output)[:, -1].clone()
    out = attack(live, solos, src)
    assert torch.equal(out, model.trace(PROMPTS[0], local))


@pytest.mark.parametrize("body, match", [
    ("h[0, 0, 0] = float('nan')", "inf or nan"),
    ("m.transformer.h[0].output = torch.full_like(h, float('inf'))", "inf or nan"),
    ("m.transformer.h[0].output = h[:, :1]", "shape"),
    ("m.transformer.h[0].output = h.double()", "dtype"),
])
def test_write_back_is_checked(live, solos, body, match):
    src = HEAD + f"async def f(m):\n    h = await m.transformer.h[0].output\n    {body}\n    await m.lm_head.output\n"
    refused_at_call(live, solos, src, match)


LATE_EDIT = HEAD + """
async def f(m):
    h = await m.transformer.h[0].output
    await m.transformer.h[1].attn.output
    h.fill_(1e4)      # past h's point, before block 1 adds h (its residual) again: the copy takes it, the model not
    out = await m.lm_head.output
    return out[:, -1].clone(), h[:, -1, :4].clone()
"""


def test_an_awaited_copy_edited_after_its_point_changes_nothing_alone_or_batched(live, model, solos):
    """Alone in its forward, the copy shares the model's memory until a side writes (copy-on-write); batched with
    the innocents, it is an ordinary copy of its row. Either way the late edit stays in the copy."""
    want = model.trace(PROMPTS[0], last)
    with Client(live.url, api_key=KEY, timeout=60) as c:
        alone = c.trace(PROMPTS[0], LATE_EDIT)
    batched = attack(live, solos, LATE_EDIT)
    for logits, h in (alone, batched):
        assert torch.allclose(logits, want, atol=1e-5)
        assert torch.equal(h, torch.full((1, 4), 1e4))
    assert torch.equal(model.trace(PROMPTS[0], last), want)


# --------------------------------------------------------------------------- 3. other users' prompts
@pytest.mark.parametrize("body, match", [
    ("return torch.as_strided_copy(ids, (64,), (1,))", "'as_strided_copy'"),
    ("return ids.as_strided((64,), (1,))", "'as_strided'"),
    ("return torch.as_strided_scatter(ids, ids, (64,), (1,))", "'as_strided_scatter'"),
    ("return ids.storage()", "'storage'"),
    ("return torch.narrow_copy(ids, 1, 0, 1)", "'narrow_copy'"),
])
def test_strided_reads_beyond_own_rows_refused(live, solos, body, match):
    src = HEAD + f"async def f(m):\n    ids = (await m.transformer.wte.inputs)[0][0]\n    {body}\n"
    refused_before_model_work(live, solos, src, match)


def test_own_ids_are_only_own_rows(live, solos, model):
    src = HEAD + '''
async def f(m):
    args, kwargs = await m.transformer.wte.inputs
    ids = args[0]
    return ids.clone(), ids.view(-1).shape[0], ids.unfold(1, 1, 1).numel()
'''
    ids, n, k = attack(live, solos, src)
    own = model.tokenizer(PROMPTS[0], return_tensors="pt")["input_ids"]
    assert torch.equal(ids, own) and n == own.numel() == k


# --------------------------------------------------------------------------- 5. uninitialised memory
@pytest.mark.parametrize("expr, match", [
    ("torch.empty(1000, dtype=torch.long)", "'empty'"),
    ("torch.empty_like(h)", "'empty_like'"),
    ("h.new_empty((1000,))", "'new_empty'"),
    ("torch.empty_strided((1000,), (1,))", "'empty_strided'"),
    ("torch.empty_permuted((1000,), (0,))", "'empty_permuted'"),
    ("h.resize_(10**4)", "'resize_'"),
])
def test_uninitialised_memory_refused(live, solos, expr, match):
    src = HEAD + f"async def f(m):\n    h = await m.transformer.h[0].output\n    return {expr}\n"
    refused_before_model_work(live, solos, src, match)


def test_tensor_constructor_refused_at_call(live, solos):
    src = HEAD + "async def f(m):\n    h = await m.transformer.h[0].output\n    T = torch.Tensor\n    return T(1000)\n"
    refused_at_call(live, solos, src, "torch.Tensor(...)")


# --------------------------------------------------------------------------- 6. one size cap
@pytest.mark.parametrize("expr", [
    "torch.zeros(size=(2**27,))",
    "torch.zeros((2**27,))",
    "torch.zeros(2**14, 2**13)",
    "torch.ones(torch.Size([2**27]))",
    "torch.full((2**27,), 1.0)",
    "torch.rand(size=[2**27])",
    "torch.randint(0, 5, size=(2**27,))",
    "torch.arange(2**28)",
    "torch.linspace(0, 1, 2**28)",
    "torch.eye(2**14)",
    "torch.zeros_like(torch.zeros(1)).expand(2**28)",
    "h.new_zeros(2**27)",
    "h.new_full((2**27,), 1.0)",
    "h.new_ones(size=(2**27,))",
    "h.expand(2**20, -1, -1)",
    "h.repeat(2**12, 2**8, 1)",
    "h.repeat_interleave(2**22, dim=0)",
    "torch.ones(2**14, 1) + torch.ones(1, 2**14)",
    "F.pad(h, (0, 2**28))",
    "torch.outer(torch.ones(2**14), torch.ones(2**14))",
    "torch.bincount(torch.tensor([2**30]))",
    "torch.zeros(1).repeat(2**27)",
    "torch.tile(h, (2**20,))",
    # operations whose result is bounded by their input skip the run on meta tensors: never when they upcast
    # or index with a tensor
    "torch.zeros(2**26, dtype=torch.float16).softmax(0, dtype=torch.float64)",
    "torch.zeros(2**26, dtype=torch.float16).softmax(0, torch.float64)",
    "h[torch.zeros(2**22, dtype=torch.long)]",
    "h[0, [0] * 2**22]",
])
def test_size_cap_holds_for_every_argument_form(live, solos, expr):
    src = HEAD + f"async def f(m):\n    h = await m.transformer.h[0].output\n    return {expr}\n"
    refused_at_call(live, solos, src, "exceeds the limit")


def test_runtime_refusal_names_operation_and_line(live, solos):
    src = HEAD + ("async def f(m):\n    h = await m.transformer.h[0].output\n"
                  "    return F.grid_sample(h[None], torch.zeros(1, 1, 1, 2))\n")
    out = refused_at_call(live, solos, src, "torch.nn.functional.grid_sample")
    assert "line 6" in out.message


# --------------------------------------------------------------------------- 8. large valid answers
def test_client_decodes_large_valid_answers(live):
    src = "async def f(m):\n    await m.lm_head.output\n    return list(range(70000)), 'x' * (2 * 2**20)\n"
    with Client(live.url, api_key=KEY, timeout=60) as c:
        items, text = c.trace(PROMPTS[0], src)
    assert items == list(range(70000)) and len(text) == 2 * 2**20

    async def go():
        async with AsyncClient(live.url, api_key=KEY, timeout=60) as c:
            return await c.generate(PROMPTS[0], src, max_new_tokens=1)
    assert len(asyncio.run(go()).result[0]) == 70000


# --------------------------------------------------------------------------- 9. disconnect while sending
def test_client_disconnecting_during_its_body_is_not_a_500(live, caplog):
    with caplog.at_level(logging.INFO, logger="asyncinterp.serve"):
        s = socket.create_connection(("127.0.0.1", live.port), timeout=5)
        s.sendall((f"POST /v1/trace HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                   "Content-Type: application/msgpack\r\nContent-Length: 5000\r\n\r\n").encode() + b"\x82" * 100)
        time.sleep(0.2)
        s.close()
        deadline = time.monotonic() + 10
        while not any(getattr(r, "fields", {}).get("error_kind") == "client_disconnect" for r in caplog.records):
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.05)
    assert not any(r.levelno >= logging.ERROR for r in caplog.records if r.name.startswith("asyncinterp"))
    assert not any(getattr(r, "fields", {}).get("status") == 500 for r in caplog.records)
    _healthy(live)
