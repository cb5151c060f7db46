"""Runtime edits on an ``ai.VLLM`` engine: registered, served by model name, replaced (a new prefix-cache scope),
retired, through the official ``openai`` package.

One engine (tiny Llama, prefix caching on, ``block_size=32``) and one uvicorn server that keeps jobs (a
SQLite state directory, an admin key). A per-pass edit sent as a file's text is registered with
``POST /v1/edits``; requests naming it share KV blocks with each other (the second one's prompt comes
from the cache) and equal the same edit run in process; replaced, the edit's hash and scope change, so
the first request under the new version finds nothing in the cache and answers as the new version in
process; retired, its name is a 404.
"""

import httpx
import openai
import pytest

from asyncinterp.serve.jobs.durable.service import Durable, DurableConfig
from vllm_helpers import PREFIX_BLOCK, served_engine
from vllm_helpers import tiny_dir  # noqa: F401 - fixtures are found by name

pytestmark = pytest.mark.vllm

KEY, ADMIN = "vllm-user", "vllm-admin"
NAME = "tiny-vllm"
BLOCK = PREFIX_BLOCK
N = 6
PROMPT = ("runtime edits: the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat near "
          "the old red barn, and the farmer walks slowly along the muddy path to feed the hungry cows")
EDIT = '''
SHIFT = {shift}

async def shift(m):
    h = await m.model.layers[0].hidden
    h.add_(SHIFT)
'''


@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    def setup(server):
        server.durable = Durable(server, DurableConfig(state_dir=str(tmp_path_factory.mktemp("state")),
                                                       admin_keys=(ADMIN,)))
    with served_engine(tiny_dir, setup, api_keys=[KEY, ADMIN], name=NAME) as served:
        yield served


def register(url, shift):
    r = httpx.post(f"{url}/v1/edits", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60,
                   json={"name": "shift", "source": EDIT.format(shift=shift), "function": "shift"})
    assert r.status_code == 200, r.text
    return r.json()


def in_process(vm, shift):
    ns = {}
    exec(EDIT.format(shift=shift), ns)  # noqa: S102 - the test's own edit
    ids = vm.tokenizer(PROMPT)["input_ids"]
    return vm.edit(ns["shift"]).generate({"prompt_token_ids": ids, "cache_salt": f"ref-{shift}"},
                                         max_new_tokens=N).text


def test_register_replace_retire_on_vllm(served):
    vm, srv = served
    with openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        def complete():
            r = client.completions.create(model=f"{NAME}:shift", prompt=PROMPT, max_tokens=N, temperature=0)
            return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens
        v1 = register(srv.url, 4.0)
        first, cached_first = complete()
        again, cached_again = complete()
        assert first == again == in_process(vm, 4.0)
        assert cached_first == 0 and cached_again >= BLOCK          # shared within the version's scope
        v2 = register(srv.url, -4.0)
        assert v2["hash"] != v1["hash"] and v2["version"] == 2
        text, cached = complete()
        assert cached == 0 and text == in_process(vm, -4.0) != first    # a new scope: no block of v1 is reused
        assert complete()[1] >= BLOCK
        r = httpx.delete(f"{srv.url}/v1/edits/shift", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
        assert r.status_code == 200
        with pytest.raises(openai.NotFoundError, match="no edit named 'shift'"):
            complete()
