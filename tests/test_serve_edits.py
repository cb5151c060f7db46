"""Named edits chosen by model name, and receipts, through the official ``openai`` package (transformers engine).

One uvicorn server for the module serves the tiny GPT-2 with three edits installed the way the CLI installs
them (``--edit`` options: a per-pass ``async def`` from a file, and registered interventions with fixed
parameters). An unmodified OpenAI client selects them with ``model`` alone; every answer is compared with
the same edit run in process (``model.edit(fn)``, or the registered intervention with the same parameters).
Receipts: equal for equal requests, different when the intervention, an edit, the seed or the weights differ.
"""

import functools
import textwrap
from typing import Annotated

import openai
import pytest

from asyncinterp.serve import Client, Server
from asyncinterp.serve.http.app import Range
from asyncinterp.serve.openai.model_names import install_from_options, load_edit_function, parse_edit_option
from asyncinterp.serve.openai.receipts import weights_hash
from test_serve_http import Live
from serve_helpers import model, one_thread  # noqa: F401 - fixtures are found by name

KEY = "edits-test-key"
NAME = "tiny-gpt2"
N = 6
PROMPT = "Once upon a time"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")

EDITS_FILE = '''
import torch

SHIFT = 3.0

async def up(m):
    """Shift half of block 0's output features (every forward pass)."""
    h = await m.transformer.h[0].output
    h[..., :16] += SHIFT

async def flip(m):
    h = await m.transformer.h[1].output
    h.mul_(-1.0)
'''


async def scale(m, layer: Annotated[int, Range(0, 1)], factor: Annotated[float, Range(-100, 100)] = 1.0):
    """A registered intervention (every step): scale block ``layer``'s first half; returns the top tokens."""
    tops = []
    async for _ in m.steps():
        h = await m.transformer.h[layer].output
        h[..., : h.shape[-1] // 2].mul_(factor)
        tops.append(int((await m.lm_head.output)[0, -1].argmax()))
    return tops


@pytest.fixture(scope="module")
def edits_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("edits") / "edits.py"
    path.write_text(textwrap.dedent(EDITS_FILE))
    return str(path)


@pytest.fixture(scope="module")
def served(model, edits_file):
    model.tokenizer.chat_template = CHAT_TEMPLATE
    server = Server(model, api_keys=[KEY], name=NAME, timeout=60)
    server.intervention("scale")(scale)
    install_from_options(server, [f"up={edits_file}:up", f"flip={edits_file}:flip",
                                  "half=scale:layer=1,factor=0.25"])
    srv = Live(server)
    try:
        yield server, srv
    finally:
        srv.close()


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=served[1].url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def fns(edits_file):
    return {name: load_edit_function(edits_file, name) for name in ("up", "flip")}


def ext(obj):
    return obj.to_dict().get("asyncinterp")


def complete(client, model_name, **kw):
    kw.setdefault("max_tokens", N)
    kw.setdefault("temperature", 0)
    return client.completions.create(model=model_name, prompt=kw.pop("prompt", PROMPT), **kw)


# ----------------------------------------------------------------------------- names
def test_models_lists_the_model_and_each_edit(client, served):
    ids = [m.id for m in client.models.list().data]
    assert ids == [NAME, f"{NAME}:up", f"{NAME}:flip", f"{NAME}:half"]
    listed = {m.id: m.to_dict() for m in client.models.list().data}
    assert listed[f"{NAME}:up"]["parent"] == NAME
    assert listed[f"{NAME}:up"]["asyncinterp"]["edits"][0]["hash"] == served[0].names.edits["up"].digest


def test_an_unknown_model_name_is_a_404_listing_the_names(client):
    for bad in (f"{NAME}:nope", "other-model", f"{NAME}:up+up", f"{NAME}:"):
        with pytest.raises(openai.NotFoundError) as info:
            complete(client, bad)
        err = info.value.body
        assert err["param"] == "model" and err["type"] == "not_found_error"
        assert f"'{NAME}:up'" in err["message"] and f"'{NAME}:half'" in err["message"]


# ----------------------------------------------------------------------------- edits equal the in-process edit
def test_an_edit_chosen_by_name_equals_model_edit_in_process(client, model, fns):
    plain = complete(client, NAME).choices[0].text
    assert plain == model.generate(PROMPT, max_new_tokens=N).text
    for name in ("up", "flip"):
        want = model.edit(fns[name]).generate(PROMPT, max_new_tokens=N).text
        got = complete(client, f"{NAME}:{name}")
        assert got.choices[0].text == want and got.model == f"{NAME}:{name}"
        assert "result" not in ext(got)               # the edit's own value is not the client's business
    assert complete(client, f"{NAME}:up").choices[0].text != plain   # (the edits do change the answer)
    assert complete(client, f"{NAME}:flip").choices[0].text != plain


def test_a_registered_intervention_with_fixed_parameters_as_an_edit(client, model):
    want = model.generate(PROMPT, functools.partial(scale, layer=1, factor=0.25), max_new_tokens=N).text
    assert complete(client, f"{NAME}:half").choices[0].text == want
    assert want != model.generate(PROMPT, max_new_tokens=N).text


def test_edits_combine_in_the_order_named(client, model, fns):
    both = model.edit(fns["up"]).edit(fns["flip"]).generate(PROMPT, max_new_tokens=N).text
    assert complete(client, f"{NAME}:up+flip").choices[0].text == both
    reverse = model.edit(fns["flip"]).edit(fns["up"]).generate(PROMPT, max_new_tokens=N).text
    assert complete(client, f"{NAME}:flip+up").choices[0].text == reverse


def test_an_edit_with_the_requests_own_intervention(client, model, fns):
    own = {"intervention": "scale", "params": {"layer": 0, "factor": -2.0}}
    resp = complete(client, f"{NAME}:up", extra_body={"asyncinterp": own})
    local = model.edit(fns["up"]).generate(PROMPT, functools.partial(scale, layer=0, factor=-2.0), max_new_tokens=N)
    assert resp.choices[0].text == local.text
    assert ext(resp)["result"] == local.result          # the request's own result, not the edit's
    alone = model.generate(PROMPT, functools.partial(scale, layer=0, factor=-2.0), max_new_tokens=N)
    assert alone.result != local.result                  # its intervention saw the edited model


def test_chat_and_streaming_under_an_edit(client, model, fns):
    messages = [{"role": "user", "content": "Tell me a story"}]
    ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = model.edit(fns["up"]).generate(ids, max_new_tokens=N).text
    chat = client.chat.completions.create(model=f"{NAME}:up", messages=messages, max_tokens=N, temperature=0)
    assert chat.choices[0].message.content == want
    text, final = "", None
    for chunk in client.chat.completions.create(model=f"{NAME}:up", messages=messages, max_tokens=N,
                                                temperature=0, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.finish_reason is not None:
                final = ext(chunk)
    assert text == want
    assert final["receipt"] == ext(chat)["receipt"]     # the stream's final chunk carries the same receipt
    streamed = "".join(c.choices[0].text for c in complete(client, f"{NAME}:flip", stream=True) if c.choices)
    assert streamed == complete(client, f"{NAME}:flip").choices[0].text


# ----------------------------------------------------------------------------- receipts
def test_equal_requests_get_equal_receipts_and_any_change_changes_it(client, served, model):
    server = served[0]
    a = ext(complete(client, f"{NAME}:up"))["receipt"]
    b = ext(complete(client, f"{NAME}:up"))["receipt"]
    assert a == b
    assert a["model"] == f"{NAME}:up" and a["base"] == NAME and a["engine"] == "transformers"
    assert a["weights"] == weights_hash(model.module) and a["weights"].startswith("sha256:")
    assert a["edits"] == [{"name": "up", "hash": server.names.edits["up"].digest}]
    assert a["intervention"] is None and a["seed"] is None
    digests = {a["digest"]}
    for changed in (complete(client, NAME), complete(client, f"{NAME}:flip"), complete(client, f"{NAME}:up+flip"),
                    complete(client, f"{NAME}:up", prompt="Once upon a"),
                    complete(client, f"{NAME}:up", max_tokens=N - 1),
                    complete(client, f"{NAME}:up", extra_body={"asyncinterp": {
                        "intervention": "scale", "params": {"layer": 0, "factor": 2.0}}}),
                    complete(client, f"{NAME}:up", extra_body={"asyncinterp": {
                        "intervention": "scale", "params": {"layer": 0, "factor": 3.0}}})):
        digests.add(ext(changed)["receipt"]["digest"])
    assert len(digests) == 8
    seeded = [ext(complete(client, NAME, temperature=1.0, seed=s))["receipt"] for s in (1, 1, 2)]
    assert seeded[0] == seeded[1] and seeded[0]["seed"] == 1
    assert seeded[2]["seed"] == 2 and seeded[2]["digest"] != seeded[0]["digest"]


def test_the_native_endpoints_carry_receipts(served):
    with Client(served[1].url, api_key=KEY, timeout=60) as c:
        g = c.generate(PROMPT, "scale", layer=0, factor=2.0, max_new_tokens=3)
        again = c.generate(PROMPT, "scale", layer=0, factor=2.0, max_new_tokens=3)
        other = c.generate(PROMPT, "scale", layer=0, factor=2.5, max_new_tokens=3)
        streamed = [ev for ev in c.stream_generate(PROMPT, "scale", layer=0, factor=2.0, max_new_tokens=3)]
    assert g.receipt == again.receipt and g.receipt["intervention"]["name"] == "scale"
    assert other.receipt["digest"] != g.receipt["digest"]
    assert streamed[-1]["result"].receipt == g.receipt


def test_a_changed_edit_file_changes_the_edit_hash(tmp_path, served, model):
    path = tmp_path / "edits.py"
    path.write_text(textwrap.dedent(EDITS_FILE))
    other = tmp_path / "edits2.py"
    other.write_text(textwrap.dedent(EDITS_FILE).replace("SHIFT = 3.0", "SHIFT = 3.5"))
    first, second = Server(model, name=NAME), Server(model, name=NAME)
    install_from_options(first, [f"up={path}:up"])
    install_from_options(second, [f"up={other}:up"])
    assert first.names.edits["up"].digest == served[0].names.edits["up"].digest   # same content, same hash
    assert second.names.edits["up"].digest != first.names.edits["up"].digest


# ----------------------------------------------------------------------------- the option syntax
def test_edit_options_parse_and_refuse_clearly(model, edits_file):
    assert parse_edit_option("a=x.py:f") == ("a", ("file", "x.py", "f"))
    assert parse_edit_option('s=steer:module=transformer.h.0,vector=[1, 2],strength=4') == (
        "s", ("intervention", "steer", {"module": "transformer.h.0", "vector": [1, 2], "strength": 4}))
    assert parse_edit_option('s=steer:{"strength": 2}') == ("s", ("intervention", "steer", {"strength": 2}))
    server = Server(model, name=NAME)
    for bad, words in (("noequals", "NAME=FILE.py"), ("a=x.py", "name the function"),
                       ("a=nothere:k=1", "no registered intervention named 'nothere'"),
                       (f"a={edits_file}:missing", "defines no 'missing'"),
                       ("a b=steer", "1-64 letters"), ("a=steer:strength=4", "needs parameter 'module'"),
                       ("a=steer:module=transformer.h.0,vector=[1.0],strength=1e9", "must be in")):
        with pytest.raises((ValueError, FileNotFoundError)) as info:
            install_from_options(server, [bad])
        assert words in str(info.value), (bad, info.value)
    with pytest.raises(TypeError, match="async def"):
        server.add_edit("plain", lambda m: None)
    server.add_edit("ok", load_edit_function(edits_file, "up"))
    with pytest.raises(ValueError, match="already taken"):
        server.add_edit("ok", load_edit_function(edits_file, "flip"))
    width = model.config.n_embd
    install_from_options(server, [f"s=steer:module=transformer.h.0,vector={[0.5] * width},strength=2"])
    assert server.names.edits["s"].origin.startswith("steer:module=transformer.h.0")
    from asyncinterp.serve.workers.supervisor import ProcessIsolation
    isolated = Server(model, name=NAME, isolation=ProcessIsolation())   # edits run in its worker processes
    try:
        isolated.add_edit("up", load_edit_function(edits_file, "up"))
        assert isolated.names.resolve(f"{NAME}:up").edits[0].name == "up"
    finally:
        isolated.batcher.close()


def test_lora_module_options_parse_as_vllms():
    """``--lora-modules a=PATH b=PATH`` (several after one flag, as vLLM's), repeated, and vLLM's JSON form."""
    import argparse
    from asyncinterp.serve import cli
    from asyncinterp.serve.openai.model_names import parse_lora_option
    p = argparse.ArgumentParser()
    cli.configure(p)
    args = p.parse_args(["dir", "--engine", "vllm", "--lora-modules", "a=/x", "b=/y=z",
                         "--lora-modules", '{"name": "c", "path": "/w", "base_model_name": "dir"}'])
    assert args.model == "dir"
    assert [parse_lora_option(t) for t in args.lora_modules] == [("a", "/x"), ("b", "/y=z"), ("c", "/w")]
    for bad, words in (("a", "NAME=PATH"), ("=x", "NAME=PATH"), ('{"name": "a"}', '"path": PATH'),
                       ("{nope", "not valid JSON")):
        with pytest.raises(ValueError, match="--lora-modules") as info:
            parse_lora_option(bad)
        assert words in str(info.value), (bad, info.value)


def test_the_cli_installs_edits_and_names_them(model, fns, edits_file):
    """``asyncinterp serve tiny-gpt2 --allow-code --edit up=edits.py:up --edit s=steer:...``, a real subprocess
    (with --allow-code the model and the edits run in supervised worker processes)."""
    import os
    import subprocess
    import sys
    from serve_helpers import stop_server, wait_healthy
    from test_serve_http import free_port
    port = free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "src"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    vector = [0.5] * model.config.n_embd
    proc = subprocess.Popen([sys.executable, "-m", "asyncinterp.serve.cli", "tiny-gpt2", "--port", str(port),
                             "--threads", "1", "--allow-code", "--edit", f"up={edits_file}:up",
                             "--edit", f"s=steer:module=transformer.h.0,vector={vector},strength=2"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", timeout=120)
        import httpx
        assert httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=10).json()["isolation"] == "process"
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60) as c:
            assert [m.id for m in c.models.list().data] == ["tiny-gpt2", "tiny-gpt2:up", "tiny-gpt2:s"]
            got = c.completions.create(model="tiny-gpt2:up", prompt=PROMPT, max_tokens=N, temperature=0)
            assert got.choices[0].text == model.edit(fns["up"]).generate(PROMPT, max_new_tokens=N).text
            assert ext(got)["receipt"]["weights"] == weights_hash(model.module)    # the same tiny weights
    finally:
        _, records = stop_server(proc)
    started = [r for r in records if r.get("event") == "startup" and r.get("msg") == "serving"]
    assert started and started[0]["models"] == ["tiny-gpt2", "tiny-gpt2:up", "tiny-gpt2:s"]
