"""The live vLLM engine: requests join a running generation, stream step by step, and never share edited KV.

One engine per module (tiny Llama, prefix caching on, 32-token blocks so
that short prompts fill whole cacheable blocks).
"""

import time

import anyio
import pytest
import torch

import asyncinterp as ai
from asyncinterp.serve import Batcher, emit
from vllm_helpers import ENGINE, hf_model, make_tiny_dir, require_vllm
from vllm_helpers import tiny_dir  # noqa: F401 - fixtures are found by name

pytestmark = pytest.mark.vllm

LONG = "Once upon a time"
SHORT = "Hello"
# 64+ tokens: two full 32-token blocks that vLLM's prefix cache can share
SHARED = ("The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat near the old "
          "red barn, and the farmer walks slowly along the muddy path to feed the hungry cows and the "
          "stone fireplace in the quiet house, where the children read old books about dragons, kings, "
          "castles and the long winter nights of the north")


@pytest.fixture(scope="module")
def vm(tiny_dir):
    require_vllm()
    model = ai.VLLM(tiny_dir, enable_prefix_caching=True, block_size=32, **ENGINE)
    yield model
    model.close()


@pytest.fixture(scope="module")
def hf(tiny_dir):
    return hf_model(tiny_dir)


def test_short_request_joins_a_long_generation_and_finishes_first(vm):
    marks = {}

    async def probe(m):
        await m.logits
        return vm.loop.steps          # engine steps completed before this request's first step

    async def main():
        started = anyio.Event()
        order = []

        async def long():
            async for ev in vm.astream(LONG, max_new_tokens=150, ignore_eos=True):
                if ev["event"] == "token" and ev["step"] == 10:
                    started.set()
            order.append("long")

        async def short():
            await started.wait()
            marks["submitted"] = vm.loop.steps
            async for ev in vm.astream(SHORT, probe, max_new_tokens=2, ignore_eos=True):
                if ev["event"] == "done":
                    marks["first_step"] = ev["result"].result
            order.append("short")

        async with anyio.create_task_group() as tg:
            tg.start_soon(long)
            tg.start_soon(short)
        return order

    order = anyio.run(main)
    assert order == ["short", "long"]
    # it took part in an engine step at most 3 steps after it was submitted (the long one kept running)
    assert marks["first_step"] - marks["submitted"] <= 3


def test_tokens_and_emits_stream_step_by_step(vm):
    async def tell(m):
        async for step in m.steps():
            logits = await m.logits
            emit(float(logits.max()))

    async def main():
        seen = []
        async for ev in vm.astream(LONG, tell, max_new_tokens=40, ignore_eos=True):
            seen.append((ev["event"], vm.loop.steps, time.monotonic()))
        return seen

    seen = anyio.run(main)
    tokens = [s for s in seen if s[0] == "token"]
    emits = [s for s in seen if s[0] == "emit"]
    assert len(tokens) == 40 and len(emits) == 40 and seen[-1][0] == "done"
    # they arrived while the engine was still generating, not all at the end
    assert len({s[1] for s in tokens}) >= 5
    assert tokens[0][2] < tokens[-1][2]


def test_stream_matches_generate_and_leaving_early_aborts(vm):
    full = vm.generate(LONG, max_new_tokens=12, ignore_eos=True)

    async def main():
        got = []
        async for ev in vm.astream(LONG, max_new_tokens=12, ignore_eos=True):
            if ev["event"] == "token":
                got.append(ev["token"])
            else:
                done = ev["result"]
        partial = []
        async for ev in vm.astream(LONG, max_new_tokens=100, ignore_eos=True):
            partial.append(ev)
            if len(partial) == 3:
                break
        return got, done

    got, done = anyio.run(main)
    assert got == full.token_ids == done.token_ids and done.text == full.text
    deadline = time.monotonic() + 10
    while vm.llm_engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not vm.llm_engine.has_unfinished_requests()


def _hf_logprobs(hf, ids):
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1]
    return torch.log_softmax(logits.float(), -1)


def test_an_edited_request_does_not_leak_through_the_prefix_cache(vm, hf):
    prompt = SHARED + " one"
    ids = vm.tokenizer(prompt)["input_ids"]
    assert len(ids) >= 64

    async def shift(m):
        h = await m.model.layers[0].hidden
        h += 4.0                                     # every position: all of its KV blocks are edited
        return (await m.logits).clone()

    edited = vm.trace(prompt, shift)
    ref = _hf_logprobs(hf, ids)
    assert (torch.log_softmax(edited[0], -1) - ref).abs().max() > 1e-2   # the edit did change things
    # a later plain request with the same prompt (another user) must see none of it
    plain = vm.generate(prompt, max_new_tokens=1, logprobs=5)
    top = plain.logprobs[0]
    for tid, lp in top.items():
        assert abs(lp - float(ref[tid])) < 1e-4, (tid, lp, float(ref[tid]))


def test_an_intervened_request_sees_every_prompt_position(vm):
    prompt = SHARED + " two"
    n = len(vm.tokenizer(prompt)["input_ids"])
    vm.generate(prompt, max_new_tokens=1)          # plain: fills the prefix cache with this prompt's blocks
    vm.generate(prompt, max_new_tokens=1)

    async def read(m):
        h = await m.model.layers[0].hidden
        return h.shape[1], m.request.computed

    seen, computed = vm.trace(prompt, read)
    assert (seen, computed) == (n, 0)


def test_plain_requests_keep_sharing_the_prefix_cache(vm):
    prompt = SHARED + " three"
    vm.generate(prompt, max_new_tokens=1)
    second = vm.generate(prompt, max_new_tokens=1)

    async def read(m):
        await m.logits

    intervened = vm.generate(prompt, read, max_new_tokens=1)
    assert second.cached_tokens >= 64          # whole blocks shared between plain requests
    assert intervened.cached_tokens == 0       # its own blocks, always


def test_batcher_streams_vllm_tokens_and_emits_live(vm):
    async def tell(m):
        async for step in m.steps():
            emit(step)

    async def main():
        async with Batcher(vm) as b:
            events = []
            async for ev in b.stream_generate(LONG, tell, max_new_tokens=20, ignore_eos=True):
                events.append((ev, vm.loop.steps))
            return events

    events = anyio.run(main)
    kinds = [e["event"] for e, _ in events]
    assert kinds.count("token") == 20 and kinds.count("emit") == 20 and kinds[-1] == "done"
    assert [e["value"] for e, _ in events if e["event"] == "emit"] == list(range(20))
    assert len({s for e, s in events if e["event"] == "token"}) >= 5
    done = events[-1][0]["result"]
    assert len(done.tokens) == 20
