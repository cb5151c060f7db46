"""Named edits chosen by model name on an ``ai.VLLM`` engine, through the official ``openai`` package.

One engine and one uvicorn server for the module (tiny Llama, prefix caching on, ``block_size=32``) with
two per-pass edits (``shift``, ``poison``). Checked as a user would:

* edit selection by ``model`` equals the same edit run in process (``vm.edit(fn).generate``), completions,
  chat and streaming, alone, combined, and with a request's own intervention;
* the prefix cache is shared among requests under the same edit set, and never across sets, with plain
  requests, or with requests that add their own intervention. Attacked as in ``test_serve_prefix_cache``:
  tenant A fills the cache under an edit that poisons every position's KV; tenant B's plain answers and
  answers under another edit equal those from a cache namespace nobody else touched; a ``cache_salt``
  that spells the edit set's scope reaches nothing;
* receipts name the vLLM engine.

Prompts start with each test's own words, so one test's cache entries cannot reach another's blocks.
"""

import functools
import secrets

import openai
import pytest

from vllm_helpers import PREFIX_BLOCK, served_engine
from vllm_helpers import tiny_dir  # noqa: F401 - fixtures are found by name

pytestmark = pytest.mark.vllm

KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"
NAME = "tiny-vllm"
BLOCK = PREFIX_BLOCK
N = 8
SHARED = ("the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat near the old "
          "red barn, and the farmer walks slowly along the muddy path to feed the hungry cows and the "
          "stone fireplace in the quiet house, where the children read old books about dragons, kings, "
          "castles and the long winter nights of the north")


async def shift(m):
    """Shift layer 0's residual stream at every position (one forward pass)."""
    h = await m.model.layers[0].hidden
    h.add_(4.0)


async def poison(m):
    """Add 100 to layer 0's attention values at every position: what its KV blocks store."""
    v = await m.model.layers[0].attn.v
    v.add_(100.0)


async def own(m, amount: float = -3.0):
    """A request's own intervention (every step): shifts layer 1's residual; returns the steps it saw."""
    n = 0
    async for _ in m.steps():
        h = await m.model.layers[1].hidden
        h.add_(amount)
        n += 1
    return n


def prompt(words):
    return f"{words}: {SHARED}"


@pytest.fixture(scope="module")
def served(tiny_dir):
    def setup(server):
        server.intervention("own")(own)
        server.add_edit("shift", shift)
        server.add_edit("poison", poison)
    with served_engine(tiny_dir, setup, api_keys=[KEY_A, KEY_B], name=NAME) as served:
        yield served


@pytest.fixture(scope="module")
def vm(served):
    return served[0]


@pytest.fixture(scope="module")
def oai_a(served):
    with openai.OpenAI(base_url=served[1].url + "/v1", api_key=KEY_A, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def oai_b(served):
    with openai.OpenAI(base_url=served[1].url + "/v1", api_key=KEY_B, max_retries=0, timeout=60) as c:
        yield c


def complete(oai, model, text, **body):
    """A greedy completion: ``(text, cached prompt tokens, the asyncinterp extension field)``."""
    resp = oai.completions.create(model=model, prompt=text, max_tokens=N, temperature=0, extra_body=body or None)
    return resp.choices[0].text, resp.usage.prompt_tokens_details.cached_tokens, resp.to_dict()["asyncinterp"]


def fresh(oai, model, text):
    """``model``'s answer from a cache namespace nobody else uses: nothing any tenant did can be in it."""
    answer, cached, _ = complete(oai, model, text, cache_salt="ref-" + secrets.token_urlsafe(24))
    assert cached == 0
    return answer


def test_models_and_an_edit_by_name_equal_the_in_process_edit(vm, oai_a):
    assert [m.id for m in oai_a.models.list().data] == [NAME, f"{NAME}:shift", f"{NAME}:poison"]
    text = prompt("Alpha")
    for name, fns in (("shift", (shift,)), ("poison", (poison,)), ("shift+poison", (shift, poison))):
        edited = vm
        for fn in fns:
            edited = edited.edit(fn)
        want = edited.generate(text, max_new_tokens=N).text
        got, _, ext = complete(oai_a, f"{NAME}:{name}", text)
        assert got == want, name
        assert ext["receipt"]["engine"] == "vllm" and [e["name"] for e in ext["receipt"]["edits"]] == name.split("+")
    assert complete(oai_a, NAME, text)[0] == vm.generate(text, max_new_tokens=N).text
    assert want != vm.generate(text, max_new_tokens=N).text


def test_chat_streaming_and_a_requests_own_intervention_under_an_edit(vm, oai_a):
    messages = [{"role": "user", "content": prompt("Beta")}]
    ids = vm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = vm.edit(shift).generate({"prompt_token_ids": ids}, max_new_tokens=N).text
    chat = oai_a.chat.completions.create(model=f"{NAME}:shift", messages=messages, max_tokens=N, temperature=0)
    assert chat.choices[0].message.content == want
    streamed = "".join(c.choices[0].delta.content or "" for c in oai_a.chat.completions.create(
        model=f"{NAME}:shift", messages=messages, max_tokens=N, temperature=0, stream=True) if c.choices)
    assert streamed == want
    text = prompt("Gamma")
    local = vm.edit(shift).generate(text, functools.partial(own, amount=-3.0), max_new_tokens=N)
    got, cached, ext = complete(oai_a, f"{NAME}:shift", text, asyncinterp={"intervention": "own",
                                                                            "params": {"amount": -3.0}})
    assert got == local.text and ext["result"] == local.result == N
    assert got != vm.edit(shift).generate(text, max_new_tokens=N).text


def test_the_prefix_is_shared_within_an_edit_set_and_never_across(vm, oai_a, oai_b):
    text = prompt("Delta")
    assert len(vm.tokenizer(text)["input_ids"]) > 2 * BLOCK
    ref_plain = fresh(oai_b, NAME, text)
    ref_shift = fresh(oai_b, f"{NAME}:shift", text)
    assert ref_shift == vm.edit(shift).generate(text, max_new_tokens=N).text

    # tenant A fills the cache under the poisoning edit
    poisoned, cached, _ = complete(oai_a, f"{NAME}:poison", text)
    assert cached == 0 and poisoned != ref_plain
    again, cached, _ = complete(oai_a, f"{NAME}:poison", text)
    assert again == poisoned and cached >= 2 * BLOCK               # shared within the edit set

    # neither plain requests nor another edit set read those blocks
    plain, cached, _ = complete(oai_b, NAME, text)
    assert plain == ref_plain and cached == 0
    shifted, cached, _ = complete(oai_b, f"{NAME}:shift", text)
    assert shifted == ref_shift and cached == 0
    shifted, cached, _ = complete(oai_b, f"{NAME}:shift", text)
    assert shifted == ref_shift and cached >= 2 * BLOCK            # the shift set shares its own
    both, cached, _ = complete(oai_b, f"{NAME}:poison+shift", text)
    assert cached == 0                                               # a set is its edits, in order
    plain, cached, _ = complete(oai_b, NAME, text)
    assert plain == ref_plain and cached >= 2 * BLOCK               # plain requests still share theirs

    # a request that adds its own intervention shares nothing (it sees every position)
    _, cached, ext = complete(oai_a, f"{NAME}:poison", text, asyncinterp={"intervention": "own"})
    assert cached == 0 and ext["result"] == N


def test_a_tenant_cannot_reach_an_edit_sets_blocks_with_a_cache_salt(served, vm, oai_a, oai_b):
    server = served[1].server
    text = prompt("Epsilon")
    ref_plain = fresh(oai_b, NAME, text)
    complete(oai_a, f"{NAME}:poison", text)
    assert complete(oai_a, f"{NAME}:poison", text)[1] >= 2 * BLOCK
    scope = server.names.resolve(f"{NAME}:poison").scope
    for salt in (scope, f"scope-{scope}", "poison"):
        answer, cached, _ = complete(oai_b, NAME, text, cache_salt=salt)
        assert answer == ref_plain and cached == 0
    # a salt under an edit: shared only with the same salt and the same edits
    salted, cached, _ = complete(oai_a, f"{NAME}:poison", text, cache_salt="mine")
    assert cached == 0 and salted == complete(oai_a, f"{NAME}:poison", text)[0]
    assert complete(oai_a, f"{NAME}:poison", text, cache_salt="mine")[1] >= 2 * BLOCK


def test_unknown_names_and_lora_adapters_on_vllm(served, oai_a, tmp_path):
    with pytest.raises(openai.NotFoundError, match="tiny-vllm:shift"):
        oai_a.completions.create(model=f"{NAME}:calm", prompt="hi", max_tokens=2)
    (tmp_path / "adapter_config.json").write_text("{}")
    served[1].server.names.add_adapter("mylora", str(tmp_path))       # as --lora-modules mylora=PATH does
    assert "mylora" in [m.id for m in oai_a.models.list().data]
    for name in ("mylora", "mylora:shift"):   # listed, but this engine was started without it: a clear 400
        with pytest.raises(openai.BadRequestError, match="does not apply it per request"):
            oai_a.completions.create(model=name, prompt="hi", max_tokens=2)


def test_cache_scope_in_process(vm):
    """``ai.VLLM`` directly: an input's ``cache_scope`` shares blocks within the scope, with interventions."""
    ids = list(vm.tokenizer(prompt("Zeta"))["input_ids"])

    async def whole_run_shift(m):
        async for _ in m.steps():
            await shift(m)

    def run(scope=None, salt=None):
        x = {"prompt_token_ids": ids}
        if scope is not None:
            x["cache_scope"] = scope
        if salt is not None:
            x["cache_salt"] = salt
        return vm.generate(x, whole_run_shift, max_new_tokens=2)

    first = run("s1")
    again = run("s1")
    assert first.cached_tokens == 0 and again.cached_tokens >= 2 * BLOCK
    assert again.text == first.text == vm.edit(shift).generate({"prompt_token_ids": ids}, max_new_tokens=2).text
    assert run("s2").cached_tokens == 0                    # another scope
    assert run().cached_tokens == 0                        # no scope: an intervened request's own blocks
    assert run("s1", salt="x").cached_tokens == 0          # a salt splits the scope
    assert vm.generate({"prompt_token_ids": ids, "cache_salt": "s1"}, max_new_tokens=2).cached_tokens == 0
    with pytest.raises(ValueError, match="cache_scope must be a non-empty string"):
        vm.generate({"prompt_token_ids": ids, "cache_scope": ""}, max_new_tokens=1)
