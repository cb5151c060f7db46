"""Attacks on the prefix-cache guarantee through a real HTTP server (uvicorn on 127.0.0.1, an ``ai.VLLM`` engine).

The guarantee (docs/vllm.md, "Prefix caching and interventions"; docs/serving.md, "Prefix cache"): a request
with an intervention never shares KV blocks through vLLM's prefix cache (each gets a cache salt of its own),
while plain requests keep sharing it. ``tests/test_vllm_live.py`` checks it in process; here two tenants (two
API keys) attack it over HTTP, with the native clients and the official ``openai`` package:

1. tenant A poisons a long shared prefix (>= 2 full 32-token blocks) with an edit at every position
   (registered intervention with parameters, submitted code), before or while tenant B asks for the same
   prefix: B's answer equals its answer from a cache namespace A never touched (and the control with the
   salt switched off shows B's answer does change when A's blocks leak);
2. an intervened request sent after plain requests filled the cache sees every prompt position and its
   edits at early positions act (logits equal to the in-process run, and to transformers' own);
3. plain requests still share (``usage.prompt_tokens_details.cached_tokens``);
4. a tenant cannot choose or forge a ``cache_salt`` to reach an intervened request's blocks.

One engine and one server for the module (tiny Llama, prefix caching on, ``block_size=32``). Every test uses
prompts that start with its own words, so the cache state one test leaves cannot touch another's blocks
(vLLM chains block hashes from the first token). Plain requests' logits cannot be read over HTTP without
an intervention (which salts the request), so plain answers are compared by their greedy text and cache
counts; :func:`test_control_with_the_salt_switched_off_the_attacks_succeed` shows those observables catch a
leak.
"""

import asyncio
import logging
import secrets
from typing import Annotated

import httpx
import openai
import pytest
import torch

from asyncinterp.serve import AsyncClient, Client, wire
from asyncinterp.serve.http.app import Range
from vllm_helpers import PREFIX_BLOCK, hf_model, served_engine
from vllm_helpers import tiny_dir  # noqa: F401 - fixtures are found by name

pytestmark = pytest.mark.vllm

KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"
NAME = "tiny-vllm"
BLOCK = PREFIX_BLOCK
# 64+ tokens after any leading words: at least two full 32-token blocks that vLLM's prefix cache can share
SHARED = ("the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat near the old "
          "red barn, and the farmer walks slowly along the muddy path to feed the hungry cows and the "
          "stone fireplace in the quiet house, where the children read old books about dragons, kings, "
          "castles and the long winter nights of the north")
N_NEW = 8
V_WIDTH = 32      # the tiny Llama's value columns in qkv_proj's output: 1 key/value head of 32


def prompt(words: str) -> str:
    """A prompt whose first block is this test's own (``words`` first), then the long shared text."""
    return f"{words}: {SHARED}"


# ----------------------------------------------------------------------------- the server's interventions
async def poison(m, amount: Annotated[float, Range(-1000, 1000)] = 100.0):
    """Add ``amount`` to layer 0's attention values at every position and step: what its KV blocks store."""
    async for _ in m.steps():
        v = await m.model.layers[0].attn.v
        v.add_(amount)
        await m.logits


async def shift(m, amount: Annotated[float, Range(-1000, 1000)] = 4.0, zero: bool = False):
    """Shift (or zero) layer 0's residual stream at every position and step: layer 1's KV blocks follow it."""
    async for _ in m.steps():
        h = await m.model.layers[0].hidden
        if zero:
            h.zero_()
        else:
            h.add_(amount)


async def probe(m):
    """What a user checks: prompt positions layer 0 saw, positions computed before, the first-step logits."""
    h = await m.model.layers[0].hidden
    seen, computed = h.shape[1], m.request.computed
    return {"seen": seen, "computed": computed, "logits": (await m.logits)[0].clone()}


async def edit_early(m, upto: Annotated[int, Range(1, 4096)], amount: float):
    """Shift layer 0's residual stream at the first ``upto`` prompt positions (inside the cacheable blocks)."""
    h = await m.model.layers[0].hidden
    seen, computed = h.shape[1], m.request.computed
    h[:, :upto] += amount
    return {"seen": seen, "computed": computed, "logits": (await m.logits)[0].clone()}


POISON_CODE = """
async def poison(m, amount, width):
    async for step in m.steps():
        qkv = await m.model.layers[0].self_attn.qkv_proj.output
        qkv[0][..., -width:] += amount
        await m.logits
    return amount
"""

POISON = {"intervention": "poison", "params": {"amount": 100.0}}                   # the extension field
POISON_CODED = {"code": POISON_CODE, "params": {"amount": 100.0, "width": V_WIDTH}}  # the same edit, submitted

SEEN_CODE = """
async def seen(m):
    h = await m.model.layers[0].hidden
    return h.shape[1]
"""


@pytest.fixture(scope="module")
def served(tiny_dir):
    def setup(server):
        for fn in (poison, shift, probe, edit_early):
            server.intervention(fn.__name__)(fn)
    with served_engine(tiny_dir, setup, api_keys=[KEY_A, KEY_B], name=NAME, allow_code=True) as served:
        yield served


@pytest.fixture(scope="module")
def vm(served):
    return served[0]


@pytest.fixture(scope="module")
def url(served):
    return served[1].url


@pytest.fixture(scope="module")
def oai_a(url):
    with openai.OpenAI(base_url=url + "/v1", api_key=KEY_A, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def oai_b(url):
    with openai.OpenAI(base_url=url + "/v1", api_key=KEY_B, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def native_a(url):
    with Client(url, api_key=KEY_A, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def native_b(url):
    with Client(url, api_key=KEY_B, timeout=60) as c:
        yield c


def complete(oai, text, salt=None, ext=None, max_tokens=N_NEW):
    """A greedy completion: ``(text, cached prompt tokens, the asyncinterp extension field or None)``."""
    body = {}
    if salt is not None:
        body["cache_salt"] = salt
    if ext is not None:
        body["asyncinterp"] = ext
    resp = oai.completions.create(model=NAME, prompt=text, max_tokens=max_tokens, temperature=0,
                                  extra_body=body or None)
    details = resp.usage.prompt_tokens_details
    return resp.choices[0].text, details.cached_tokens, resp.to_dict().get("asyncinterp")


def fresh_reference(oai, text):
    """B's answer from a cache namespace nobody else uses (a secret salt of its own): nothing A did can be in it."""
    answer, cached, _ = complete(oai, text, salt="ref-" + secrets.token_urlsafe(24))
    assert cached == 0
    return answer


def n_tokens(vm, text):
    return len(vm.tokenizer(text)["input_ids"])


def logits(value):
    return torch.tensor(value["logits"]) if isinstance(value["logits"], list) else value["logits"]


@pytest.fixture(scope="module")
def hf(tiny_dir):
    return hf_model(tiny_dir)


def hf_greedy(hf, tokenizer, text):
    """transformers' own greedy continuation of ``text`` (a fresh engine that never saw any tenant)."""
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def hf_logprobs(hf, ids, upto=0, amount=0.0):
    """transformers' own next-token log-probabilities, with ``edit_early``'s edit done on its layer 0."""
    def hook(module, args, out):
        h = out[0] if isinstance(out, tuple) else out
        h[:, :upto] += amount
    handle = hf.model.layers[0].register_forward_hook(hook)
    try:
        with torch.no_grad():
            out = hf(torch.tensor([ids])).logits[0, -1]
    finally:
        handle.remove()
    return torch.log_softmax(out.float(), -1)


# ----------------------------------------------------------------------------- 1. poisoned prefix
def test_a_poisoned_prefix_does_not_reach_the_next_tenant(vm, hf, oai_a, oai_b, native_a, native_b):
    text = prompt("First story")
    assert n_tokens(vm, text) > 2 * BLOCK
    ref = fresh_reference(oai_b, text)
    assert ref == hf_greedy(hf, vm.tokenizer, text)
    before = native_b.trace(text, "probe")            # B's logits, read by a (salted) probe before A came
    assert before["seen"] == n_tokens(vm, text)

    # tenant A edits every position of the shared prefix, five ways
    poisoned, cached, ext = complete(oai_a, text, ext=POISON)
    assert cached == 0 and {k: v for k, v in ext.items() if k != "receipt"} == {"result": None, "emitted": []}
    assert poisoned != ref                                                     # A's edit changes A's answer
    coded, cached, ext = complete(oai_a, text, ext=POISON_CODED)
    assert cached == 0 and ext["result"] == 100.0 and coded == poisoned       # submitted code edits too
    shifted, cached, _ = complete(oai_a, text, ext={"intervention": "shift", "params": {"amount": 4.0}})
    zeroed, cached_z, _ = complete(oai_a, text, ext={"intervention": "shift", "params": {"zero": True}})
    assert cached == cached_z == 0 and shifted != ref and zeroed != ref
    native = native_a.generate(text, "poison", amount=-100.0, max_new_tokens=N_NEW)
    assert native.text != ref

    # tenant B, plain, same prefix: what it would have got had A never come
    plain, cached, _ = complete(oai_b, text)
    assert plain == ref and cached == 0          # none of A's blocks: this is the first plain request
    again, cached, _ = complete(oai_b, text)
    assert again == ref and cached >= 2 * BLOCK  # and the plain requests share their own (clean) blocks
    assert native_b.generate(text, max_new_tokens=N_NEW).text == ref
    after = native_b.trace(text, "probe")
    assert after["seen"] == before["seen"] and after["computed"] == 0
    assert torch.equal(logits(after), logits(before))
    fresh = hf_logprobs(hf, vm.tokenizer(text)["input_ids"])                   # a fresh engine: transformers'
    assert (torch.log_softmax(logits(after), -1) - fresh).abs().max() < 1e-4


def test_a_prefix_poisoned_while_the_next_tenant_arrives(vm, hf, url, oai_b):
    text = prompt("Second story")
    ref = fresh_reference(oai_b, text)
    assert ref == hf_greedy(hf, vm.tokenizer, text)
    order = []

    async def tenant_a(started):
        async with AsyncClient(url, api_key=KEY_A, timeout=60) as c:
            n = 0
            async for ev in c.stream_generate(text, "poison", amount=100.0, max_new_tokens=150):
                if ev["event"] == "token":
                    n += 1
                    if n == 2:
                        started.set()          # A's prompt is in the engine (and its blocks in the cache)
                elif ev["event"] == "done":
                    order.append("a")
                    return ev["result"]

    async def tenant_b(started):
        await started.wait()
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY_B, max_retries=0, timeout=60) as c:
            answers = []
            for _ in range(2):
                resp = await c.completions.create(model=NAME, prompt=text, max_tokens=N_NEW, temperature=0)
                answers.append((resp.choices[0].text, resp.usage.prompt_tokens_details.cached_tokens))
                order.append("b")
            async with AsyncClient(url, api_key=KEY_B, timeout=60) as c2:
                native = await c2.generate(text, max_new_tokens=N_NEW)
        return answers, native

    async def main():
        started = asyncio.Event()
        return await asyncio.gather(tenant_a(started), tenant_b(started))

    a, (answers, native) = asyncio.run(main())
    assert order[0] == "b"                       # B was answered while A's generation still ran
    assert len(a.tokens) == 150
    assert answers[0] == (ref, 0)                # nothing of A's
    assert answers[1][0] == ref and answers[1][1] >= 2 * BLOCK
    assert native.text == ref


# ----------------------------------------------------------------------------- 2. every position, after plain ones
def test_an_intervened_request_after_plain_ones_sees_and_edits_every_position(vm, hf, oai_a, oai_b, native_a):
    text = prompt("Third story")
    ids = vm.tokenizer(text)["input_ids"]
    n = len(ids)
    complete(oai_b, text)                                   # plain requests fill the cache with this prefix
    _, cached, _ = complete(oai_b, text)
    assert cached >= 2 * BLOCK

    read = native_a.trace(text, "probe")                    # registered read, native client
    assert (read["seen"], read["computed"]) == (n, 0)
    edit = {"upto": 8, "amount": 4.0}                       # positions 0..7: inside the first cached block
    edited = native_a.trace(text, "edit_early", **edit)
    assert (edited["seen"], edited["computed"]) == (n, 0)
    _, cached, ext = complete(oai_a, text, ext={"intervention": "edit_early", "params": edit}, max_tokens=1)
    assert cached == 0 and (ext["result"]["seen"], ext["result"]["computed"]) == (n, 0)
    assert torch.equal(logits(ext["result"]), logits(edited))          # OpenAI and native: the same run
    _, cached, ext = complete(oai_a, text, ext={"code": SEEN_CODE}, max_tokens=1)
    assert cached == 0 and ext["result"] == n                          # submitted code sees them all too

    # the edit acted where the in-process run (and transformers) say it does, not on the uncached tail
    local = vm.trace(text, lambda m: edit_early(m, **edit))
    assert (logits(edited) - local["logits"]).abs().max() <= 1e-5
    assert (logits(read) - logits(edited)).abs().max() > 1e-2
    ref_plain, ref_edited = hf_logprobs(hf, ids), hf_logprobs(hf, ids, **edit)
    assert (torch.log_softmax(logits(read), -1) - ref_plain).abs().max() < 1e-4
    assert (torch.log_softmax(logits(edited), -1) - ref_edited).abs().max() < 1e-4


# ----------------------------------------------------------------------------- 3. plain requests share
def test_plain_requests_keep_sharing_and_report_cached_tokens(vm, served, oai_a, oai_b, monkeypatch):
    text = prompt("Fourth story")
    n = n_tokens(vm, text)
    first, cached_first, _ = complete(oai_a, text)
    second, cached_second, _ = complete(oai_b, text)                    # plain requests share across tenants
    assert first == second and cached_first == 0 and 2 * BLOCK <= cached_second < n
    chunks = list(oai_b.completions.create(model=NAME, prompt=text, max_tokens=N_NEW, temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert "".join(c.choices[0].text for c in chunks if c.choices) == first
    assert usage.prompt_tokens == n and usage.prompt_tokens_details.cached_tokens == cached_second
    # an intervened request reports its own blocks: nothing from the cache
    _, cached, _ = complete(oai_b, text, ext={"intervention": "probe"})
    assert cached == 0
    # off by default (as in vLLM's server): the count would tell a tenant what others sent
    monkeypatch.setattr(served[1].server, "prompt_tokens_details", False)
    resp = oai_b.completions.create(model=NAME, prompt=text, max_tokens=N_NEW, temperature=0)
    assert resp.choices[0].text == first and resp.usage.prompt_tokens_details is None


def test_cli_flag_turns_the_cached_tokens_report_on(monkeypatch):
    import argparse
    from asyncinterp.serve import app, cli
    made = []

    class Made(Exception):
        pass

    def server(model, **kw):
        made.append(kw["prompt_tokens_details"])
        raise Made
    monkeypatch.setattr(app, "Server", server)
    p = argparse.ArgumentParser()
    cli.configure(p)
    for argv in ([], ["--enable-prompt-tokens-details"]):
        with pytest.raises(Made):
            cli.startup.serve_forever(p.parse_args(argv), "a model", [], logging.getLogger("test"))
    assert made == [False, True]       # off by default, as in vLLM's server


# ----------------------------------------------------------------------------- 4. chosen and forged salts
def test_a_tenant_cannot_choose_or_forge_a_cache_salt(vm, url, oai_a, oai_b, native_a, monkeypatch):
    from asyncinterp.models.vllm.jobs import LiveJob
    text = prompt("Fifth story")
    ref = fresh_reference(oai_b, text)
    salts = []                                 # what the engine was given, request by request
    real = LiveJob.cache_salt

    def spy(self, inv):
        salts.append(real(self, inv))
        return salts[-1]
    monkeypatch.setattr(LiveJob, "cache_salt", spy)

    # A picks the salt B will use, and poisons the prefix under it: its own salt replaces the chosen one
    chosen = "team-" + secrets.token_urlsafe(16)
    _, cached, _ = complete(oai_a, text, salt=chosen, ext=POISON)
    a_salt = salts[-1]
    assert cached == 0 and a_salt.startswith("asyncinterp-") and chosen not in a_salt
    _, cached, _ = complete(oai_a, text, salt=chosen, ext=POISON_CODED)
    assert cached == 0 and salts[-1].startswith("asyncinterp-")
    native_a.generate(text, "poison", amount=-100.0, max_new_tokens=N_NEW)
    assert salts[-1].startswith("asyncinterp-") and len(set(salts)) == 3      # one salt per request
    got, cached, _ = complete(oai_b, text, salt=chosen)
    assert (got, cached) == (ref, 0)           # nothing of A's under that salt
    got, cached, _ = complete(oai_b, text, salt=chosen)
    assert got == ref and cached >= 2 * BLOCK  # plain requests with one salt share, as in vLLM
    assert salts[-1] == f"user-{chosen}"

    # B forges the exact salt the engine gave A's poisoned request (same process: pid and run keys are known)
    got, cached, _ = complete(oai_b, text, salt=a_salt)
    assert (got, cached) == (ref, 0)
    # salted and unsalted plain requests do not mix, either way
    _, cached, _ = complete(oai_b, text)
    assert cached == 0
    _, cached, _ = complete(oai_b, text)
    assert cached >= 2 * BLOCK
    _, cached, _ = complete(oai_b, text, salt="other-" + secrets.token_urlsafe(8))
    assert cached == 0

    # salts as vLLM's server checks them (and as the engine's own prompts take them); the native endpoints take none
    with pytest.raises(ValueError, match="cache_salt"):
        vm.generate({"prompt_token_ids": vm.tokenizer(text)["input_ids"], "cache_salt": 5}, max_new_tokens=1)
    for bad in ["", "x" * 129, "a/b", "a@b", "a\\b", "a\x00b", 5, ["s"]]:
        with pytest.raises(openai.BadRequestError) as exc:
            complete(oai_b, text, salt=bad)
        assert exc.value.body["param"] == "cache_salt"
    ids = vm.tokenizer(text)["input_ids"]
    resp = httpx.post(url + "/v1/generate", headers={"Authorization": f"Bearer {KEY_B}",
                                                     "Content-Type": "application/msgpack"},
                      content=wire.packb({"input": {"prompt_token_ids": ids, "cache_salt": a_salt}}))
    assert resp.status_code == 400


# ----------------------------------------------------------------------------- the attacks have teeth
def test_control_with_the_salt_switched_off_the_attacks_succeed(vm, oai_a, oai_b, native_b, monkeypatch):
    """Without asyncinterp's salt the same attacks get through, and these observables show it."""
    from asyncinterp.models.vllm.jobs import LiveJob
    poisoned, filled = prompt("Control story"), prompt("Control filled")
    ref = fresh_reference(oai_b, poisoned)
    monkeypatch.setattr(LiveJob, "cache_salt", lambda self, inv: None)

    complete(oai_a, poisoned, ext=POISON)
    leaked, cached, _ = complete(oai_b, poisoned)
    assert cached >= 2 * BLOCK and leaked != ref            # failure mode 1: A's edit reached B

    complete(oai_b, filled)
    read = native_b.trace(filled, "probe")
    assert read["computed"] >= 2 * BLOCK and read["seen"] == n_tokens(vm, filled) - read["computed"]  # mode 2
