"""The OpenAI-compatible endpoints, called with the official ``openai`` package against a real uvicorn server.

Servers (one per module, in threads of this process, see ``test_serve_http.Live``) serve tiny random
models; answers are compared with ``model.generate`` run directly on the same model. One test runs the
chat template of the bundled SmolLM2 (``smollm2`` marker), one serves an ``ai.VLLM`` engine (``vllm``).
"""

import functools
from typing import Annotated

import openai
import pytest
import torch

import asyncinterp as ai
from asyncinterp.models import tiny
from asyncinterp.serve import Server
from asyncinterp.serve.http.app import Range
from test_serve_http import Live
from serve_helpers import one_thread, wait_healthy  # noqa: F401 - fixtures are found by name
from vllm_helpers import tiny_dir  # noqa: F401 - fixtures are found by name

KEY = "openai-test-key"
NAME = "tiny-gpt2"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


THREADS = torch.get_num_threads()


@pytest.fixture(scope="module")
def model():
    lm = tiny("gpt2")
    lm.tokenizer.chat_template = CHAT_TEMPLATE     # this model's own tokenizer object: nobody else sees it
    return lm


async def scale(m, layer: Annotated[int, Range(0, 1)], factor: Annotated[float, Range(-100, 100)] = 1.0):
    """Scale the first half of a block's output features at every step; emit and return each step's top token."""
    tops = []
    async for step in m.steps():
        h = await m.transformer.h[layer].output
        h[..., : h.shape[-1] // 2].mul_(factor)
        top = int((await m.lm_head.output)[0, -1].argmax())
        ai.serve.emit({"step": step, "top": top})
        tops.append(top)
    return tops


async def fail_at_step(m, step: int = 1):
    async for s in m.steps():
        await m.transformer.h[0].output
        if s == step:
            raise ValueError(f"failed on purpose at step {s}")


async def last_logits(m):
    out = None
    async for _ in m.steps():
        out = (await m.lm_head.output)[:, -1, :4].clone()
    return out


RECORD = []


async def slow_steps(m):
    import time
    try:
        async for step in m.steps():
            await m.transformer.h[0].output
            RECORD.append(step)
            time.sleep(0.05)
    finally:
        RECORD.append("closed")


def make_server(model, **kw):
    server = Server(model, api_keys=[KEY], name=NAME, max_wait_ms=2, timeout=30, **kw)
    for fn in (scale, fail_at_step, last_logits, slow_steps):
        server.intervention(fn.__name__)(fn)
    return server


@pytest.fixture(scope="module")
def live(model):
    srv = Live(make_server(model, allow_code=True, exact=True))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def plain_client():
    """A second server: a model without a chat template, submitted code not allowed."""
    srv = Live(make_server(tiny("gpt2")))
    try:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
            yield c
    finally:
        srv.close()


def ext(obj):
    """The ``asyncinterp`` extension field of a response or chunk."""
    return obj.to_dict().get("asyncinterp")


def collect(stream):
    """Text, finish reason, usage, live emits and final extension of a streamed completion or chat."""
    text, reason, usage, emits, final, n_chunks = "", None, None, [], None, 0
    for chunk in stream:
        n_chunks += 1
        extra = ext(chunk)
        if extra and "emit" in extra:
            emits.append(extra["emit"])
        if extra and "result" in extra:
            final = extra
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            text += piece or ""
            if choice.finish_reason is not None:
                reason = choice.finish_reason
    return {"text": text, "reason": reason, "usage": usage, "emits": emits, "final": final, "chunks": n_chunks}


def chat_ids(model, messages):
    ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


PROMPTS = ["The cat sat on the", "Once upon a time", "Paris is the capital of"]


# ----------------------------------------------------------------------------- plain generation
def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    assert models.data[0].owned_by == "asyncinterp"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_equals_local_greedy_generate(client, model, prompt):
    resp = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0)
    local = model.generate(prompt, max_new_tokens=6)
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-") and resp.model == NAME
    assert len(resp.choices) == 1 and resp.choices[0].index == 0
    assert resp.choices[0].text == local.text
    assert resp.choices[0].finish_reason == "length"
    n_prompt = len(model.tokenizer(prompt)["input_ids"])
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (n_prompt, 6, n_prompt + 6)
    assert list(ext(resp)) == ["receipt"]               # no intervention: only the receipt


def test_token_id_prompt_and_one_element_lists(client, model):
    ids = model.tokenizer(PROMPTS[0])["input_ids"]
    want = model.generate(PROMPTS[0], max_new_tokens=4).text
    for prompt in (ids, [ids], [PROMPTS[0]]):
        resp = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0)
        assert resp.choices[0].text == want


def test_streaming_completion_equals_non_streaming(client, model):
    local = model.generate(PROMPTS[1], max_new_tokens=7)
    got = collect(client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=7, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert got["text"] == local.text and got["reason"] == "length"
    assert got["chunks"] >= 7 + 1                      # one chunk per token, then the finish
    assert got["usage"].completion_tokens == 7 and got["final"] is None


def test_stop_strings_end_the_generation(client, model):
    prompt = PROMPTS[2]
    full = model.generate(prompt, max_new_tokens=8)
    pieces = [model.tokenizer.decode([t]) for t in full.tokens.tolist()]
    stop = pieces[2]                                    # the third token's text, e.g. " Priest"
    cut = full.text[:full.text.index(stop)]
    resp = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0, stop=[stop],
                                     extra_body={"asyncinterp": {"intervention": "scale", "params": {"layer": 0}}})
    assert resp.choices[0].text == cut and resp.choices[0].finish_reason == "stop"
    n = resp.usage.completion_tokens
    assert n < 8 and stop in model.tokenizer.decode(full.tokens[:n].tolist())
    assert len(ext(resp)["result"]) == n                # the intervention's step loop ended there, cleanly
    got = collect(client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0, stop=stop,
                                            stream=True))
    assert got["text"] == cut and got["reason"] == "stop"
    # the same option on the local model
    assert model.generate(prompt, max_new_tokens=8, stop=[stop]).tokens.tolist() == full.tokens[:n].tolist()


def test_concurrent_requests_with_stop_strings_each_end_at_their_own(client, model):
    from concurrent.futures import ThreadPoolExecutor
    stop = " Priest"            # ends the third prompt early; the others run to max_tokens in the same batch
    locals_ = [model.generate(p, max_new_tokens=8, stop=[stop]) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: client.completions.create(model=NAME, prompt=p, max_tokens=8,
                                                                    temperature=0, stop=[stop]), PROMPTS))
    for local, resp in zip(locals_, answers):
        assert resp.usage.completion_tokens == len(local.tokens)
        assert resp.choices[0].text == local.text.split(stop)[0]
    assert [a.choices[0].finish_reason for a in answers] == ["length", "length", "stop"]


def test_sampling_with_a_seed_is_reproducible_and_equals_local(client, model):
    kw = dict(model=NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0.9, top_p=0.95, seed=1234)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    c = client.completions.create(**dict(kw, seed=99)).choices[0].text
    local = model.generate(PROMPTS[0], max_new_tokens=6, do_sample=True, temperature=0.9, top_p=0.95, top_k=0,
                           seed=1234).text
    assert a == b == local
    assert c != a


# ----------------------------------------------------------------------------- interventions
def test_registered_intervention_with_params(client, model):
    prompt, params = PROMPTS[0], {"layer": 1, "factor": -3.0}
    local = model.generate(prompt, functools.partial(scale, **params), max_new_tokens=5)
    plain = model.generate(prompt, max_new_tokens=5)
    assert local.text != plain.text                     # the intervention changes what is generated
    body = {"asyncinterp": {"intervention": "scale", "params": params}}
    resp = client.completions.create(model=NAME, prompt=prompt, max_tokens=5, temperature=0, extra_body=body)
    assert resp.choices[0].text == local.text
    assert ext(resp)["result"] == local.result == resp.model_extra["asyncinterp"]["result"]
    assert ext(resp)["emitted"] == [{"step": i, "value": {"step": i, "top": t}} for i, t in enumerate(local.result)]

    got = collect(client.completions.create(model=NAME, prompt=prompt, max_tokens=5, temperature=0, stream=True,
                                            extra_body=body))
    assert got["text"] == local.text
    assert got["emits"] == ext(resp)["emitted"]         # emitted values arrive while generating
    assert got["final"] == ext(resp)                    # the final chunk carries the result


def test_tensor_parameters_travel_as_json_lists(client, model):
    width = model.module.config.n_embd
    vector = torch.linspace(-1, 1, width)
    params = {"module": "transformer.h.0", "vector": vector.tolist(), "strength": 3.0, "k": 3}
    resp = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=3, temperature=0,
                                     extra_body={"asyncinterp": {"intervention": "steer", "params": params}})
    from asyncinterp.serve.scheduling.builtins import steer
    local = model.generate(PROMPTS[1], functools.partial(steer, module="transformer.h.0",
                                                         vector=torch.tensor(vector.tolist()), strength=3.0, k=3),
                           max_new_tokens=3)
    assert resp.choices[0].text == local.text
    result = ext(resp)["result"]
    assert result["ids"] == local.result["ids"].tolist()
    torch.testing.assert_close(torch.tensor(result["probs"]), local.result["probs"])


CODE = """
async def read_norms(m, layer):
    import torch
    norms = []
    async for step in m.steps():
        h = await m.transformer.h[layer].output
        norms.append(torch.linalg.vector_norm(h[:, -1], dim=-1))
    return torch.stack(norms)
"""


def test_submitted_code(client, model):
    resp = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=3, temperature=0,
                                     extra_body={"asyncinterp": {"code": CODE, "params": {"layer": 1}}})
    scope = {}
    exec(CODE, scope)
    local = model.generate(PROMPTS[0], functools.partial(scope["read_norms"], layer=1), max_new_tokens=3)
    got = torch.tensor(ext(resp)["result"])             # a tensor comes back as nested lists
    assert got.shape == local.result.shape == (3, 1)
    torch.testing.assert_close(got, local.result)
    assert resp.choices[0].text == local.text


def test_chat_completion_uses_the_chat_template(client, model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    ids = chat_ids(model, messages)
    local = model.generate(ids, functools.partial(scale, layer=0, factor=2.0), max_new_tokens=5)
    body = {"asyncinterp": {"intervention": "scale", "params": {"layer": 0, "factor": 2.0}}}
    resp = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0,
                                          extra_body=body)
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    msg = resp.choices[0].message
    assert msg.role == "assistant" and msg.content == local.text
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 5
    assert ext(resp)["result"] == local.result

    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=5,
                                                 temperature=0, stream=True, extra_body=body))
    assert chunks[0].choices[0].delta.role == "assistant"
    got = collect(chunks)
    assert got["text"] == local.text and got["reason"] == "length" and got["final"] == ext(resp)


# ----------------------------------------------------------------------------- errors
def _status(exc_info, cls, status, param=None):
    err = exc_info.value
    assert isinstance(err, cls) and err.status_code == status, err
    assert set(err.body) >= {"message", "type", "param", "code"}
    if param is not None:
        assert err.body["param"] == param
    return err.body


def test_request_errors_are_openai_errors(client):
    base = dict(model=NAME, prompt="Hello there", max_tokens=2, temperature=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**base, extra_body={"asyncinterp": {"intervention": "nope"}})
    body = _status(e, openai.BadRequestError, 400, "asyncinterp")
    assert "no intervention named 'nope'" in body["message"] and body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**base, extra_body={"asyncinterp": {"intervention": "scale",
                                                                      "params": {"layer": 5}}})
    assert "must be in [0, 1]" in _status(e, openai.BadRequestError, 400, "asyncinterp")["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**base, extra_body={"asyncinterp": {"intervention": "scale",
                                                                      "params": {"layer": 0, "oops": 1}}})
    assert "no parameter" in _status(e, openai.BadRequestError, 400)["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**dict(base, temperature=0), n=2)      # as vLLM: n > 1 needs sampling
    assert "greedy" in _status(e, openai.BadRequestError, 400, "n")["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**dict(base, prompt=[[1, 2], "two", 3]))
    _status(e, openai.BadRequestError, 400, "prompt")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**base, logprobs=21)                  # vLLM's server: at most 20
    _status(e, openai.BadRequestError, 400, "logprobs")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**dict(base, max_tokens=10_000))
    _status(e, openai.BadRequestError, 400, "max_tokens")
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(**dict(base, model="gpt-4"))
    _status(e, openai.NotFoundError, 404, "model")


def test_auth_errors(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as e:
            bad.completions.create(model=NAME, prompt="Hi", max_tokens=1)
        assert e.value.body["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_intervention_errors(client):
    base = dict(model=NAME, prompt="Hello there", max_tokens=3, temperature=0)
    ext_fail = {"asyncinterp": {"intervention": "fail_at_step", "params": {"step": 1}}}
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.completions.create(**base, extra_body=ext_fail)
    body = _status(e, openai.UnprocessableEntityError, 422)
    assert body["type"] == "intervention_error" and "failed on purpose at step 1" in body["message"]
    assert body["asyncinterp"]["type"] == "ValueError"
    assert any("fail_at_step" in line for line in body["asyncinterp"]["traceback"])
    with pytest.raises(openai.APIError) as e:        # while streaming: an error event ends the stream
        collect(client.completions.create(**base, stream=True, extra_body=ext_fail))
    assert "failed on purpose" in e.value.message
    refused = "async def f(m):\n    import os\n    return os.getcwd()\n"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**base, extra_body={"asyncinterp": {"code": refused}})
    body = _status(e, openai.BadRequestError, 400, "asyncinterp")
    assert "import of 'os' is not allowed" in body["message"] and body["code"] == "refused"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**base, extra_body={"asyncinterp": {"intervention": "scale", "colour": 1}})
    _status(e, openai.BadRequestError, 400, "asyncinterp")


def test_malformed_bodies_get_openai_errors(live):
    import httpx
    url = live.url + "/v1/completions"
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    cases = [
        (b"", 400), (b"{not json", 400), (b"[1, 2]", 400), (b"[" * 100_000 + b"]" * 100_000, 400),
        (b'{"model": "tiny-gpt2"}', 400), (b'{"model": "tiny-gpt2", "prompt": 7}', 400),
        (b'{"model": "tiny-gpt2", "prompt": "hi", "max_tokens": -1}', 400),
        (b'{"model": "tiny-gpt2", "prompt": "hi", "temperature": 9}', 400),
        (b'{"model": "tiny-gpt2", "prompt": "hi", "stream": "yes"}', 400),
        (b'{"model": "tiny-gpt2", "prompt": "hi", "stop": [1]}', 400),
        (b'{"model": "tiny-gpt2", "prompt": [99999999]}', 400),
        (b'{"model": "tiny-gpt2", "prompt": "hi", "asyncinterp": "top_k"}', 400),
        (b'{"model": "tiny-gpt2", "prompt": "hi", "asyncinterp": {"intervention": "top_k", "timeout": -1}}', 400),
        (b'{"model": "tiny-gpt2", "prompt": "' + b"a" * (2 << 20) + b'"}', 413),
    ]
    with httpx.Client(timeout=30) as h:
        for body, status in cases:
            r = h.post(url, content=body, headers=auth)
            assert r.status_code == status, (body[:80], r.text)
            err = r.json()["error"]
            assert set(err) >= {"message", "type", "param", "code"} and err["message"], err
        assert h.get(url, headers=auth).status_code == 405
        assert h.post(url, content=b"{}", headers={"Content-Type": "application/json"}).status_code == 401
        assert h.get(live.url + "/v1/health").json()["status"] == "ok"


def test_leaving_a_stream_cancels_the_request(client):
    RECORD.clear()
    stream = client.completions.create(model=NAME, prompt="Hello there", max_tokens=100, temperature=0,
                                       stream=True, extra_body={"asyncinterp": {"intervention": "slow_steps"}})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            break
    stream.close()
    import time
    deadline = time.monotonic() + 20
    while "closed" not in RECORD:
        assert time.monotonic() < deadline, RECORD
        time.sleep(0.05)
    assert len(RECORD) < 50           # closed at its next hook point, long before 100 steps


def test_missing_chat_template_and_code_not_allowed(plain_client):
    with pytest.raises(openai.BadRequestError) as e:
        plain_client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert "no chat template" in _status(e, openai.BadRequestError, 400, "messages")["message"]
    with pytest.raises(openai.BadRequestError) as e:
        plain_client.completions.create(model=NAME, prompt="Hi", max_tokens=2,
                                        extra_body={"asyncinterp": {"code": CODE, "params": {"layer": 0}}})
    assert "does not accept submitted code" in _status(e, openai.BadRequestError, 400, "asyncinterp")["message"]


def test_native_endpoints_still_answer_msgpack(live):
    from asyncinterp.serve import Client
    with Client(live.url, api_key=KEY) as c:
        g = c.generate(PROMPTS[0], "scale", layer=0, max_new_tokens=2)
    assert len(g.tokens) == 2 and len(g.result) == 2


# ----------------------------------------------------------------------------- shapes, without a server
def _shaper(stop=(), max_tokens=8, extension=False):
    from asyncinterp.serve.openai.openai_compat import OpenAIRequest, Shaper
    return Shaper(OpenAIRequest("completions", NAME, prompt="x", stop=tuple(stop)), max_tokens, 1, {0},
                  extension)


def _sse_texts(raw: bytes):
    import json
    out = []
    for line in raw.decode().split("\n\n"):
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def test_stream_never_sends_a_stop_string_split_over_tokens():
    from asyncinterp.serve.scheduling.batcher import GenerateResult
    sh = _shaper(stop=["o w"])
    pieces = ["Hel", "lo", " ", "wor", "ld"]
    sent = b"".join(sh.event({"event": "token", "step": i, "token": 10 + i, "text": t}) for i, t in enumerate(pieces))
    sent += sh.event({"event": "done", "result": GenerateResult(None, [10, 11, 12, 13], "Hello wor")})
    chunks = _sse_texts(sent)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "Hell"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert sent.endswith(b"data: [DONE]\n\n")
    # a tail that only looks like the start of a stop string is sent at the end
    sh = _shaper(stop=["lo!"], max_tokens=2)
    sent = sh.event({"event": "token", "step": 0, "token": 5, "text": "Hel"})
    sent += sh.event({"event": "token", "step": 1, "token": 6, "text": "lo"})
    assert "".join(c["choices"][0]["text"] for c in _sse_texts(sent)) == "Hel"
    sent += sh.event({"event": "done", "result": GenerateResult(None, [5, 6], "Hello")})
    chunks = _sse_texts(sent)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_stream_after_a_restart_does_not_repeat_tokens():
    from asyncinterp.serve.scheduling.batcher import GenerateResult
    sh = _shaper(max_tokens=3)
    out = sh.event({"event": "token", "step": 0, "token": 7, "text": "a"})
    out += sh.event({"event": "restart"})                         # the batch failed; rerun alone
    out += sh.event({"event": "token", "step": 0, "token": 7, "text": "a"})
    out += sh.event({"event": "token", "step": 1, "token": 8, "text": "b"})
    out += sh.event({"event": "done", "result": GenerateResult(None, [7, 8], "ab")})
    assert "".join(c["choices"][0]["text"] for c in _sse_texts(out)) == "ab"
    sh = _shaper()
    sh.event({"event": "token", "step": 0, "token": 7, "text": "a"})
    sh.event({"event": "restart"})
    with pytest.raises(RuntimeError, match="retry"):
        sh.event({"event": "token", "step": 0, "token": 9, "text": "z"})


def test_results_as_json():
    from asyncinterp.serve.openai.openai_compat import to_json
    from asyncinterp.client.wire import WireError
    value = {"t": torch.tensor([[1.5, float("nan")], [float("inf"), -float("inf")]]), "h": torch.ones(2).half(),
             "tuple": (1, "a", None, True), 3: [torch.tensor(2)]}
    assert to_json(value) == {"t": [[1.5, "NaN"], ["Infinity", "-Infinity"]], "h": [1.0, 1.0],
                              "tuple": [1, "a", None, True], "3": [2]}
    for bad in (object(), torch.ones(2, dtype=torch.complex64), {(1, 2): 3}, b"bytes"):
        with pytest.raises(WireError):
            to_json(bad)


# ----------------------------------------------------------------------------- the command line
def _args(*argv):
    import argparse
    from asyncinterp.serve.cli import configure
    p = argparse.ArgumentParser()
    configure(p)
    return p.parse_args(list(argv))


def test_cli_builds_the_engine_in_one_place(monkeypatch, tmp_path):
    from asyncinterp.models import vllm as vllm_models
    from asyncinterp.serve.cli import build_model, engine_options
    made = []
    monkeypatch.setattr(vllm_models, "VLLM", lambda path, **kw: made.append((path, kw)) or "engine")
    args = _args(str(tmp_path), "--engine", "vllm", "--tensor-parallel-size", "2", "--max-model-len", "512",
                 "--engine-arg", "enable_prefix_caching=false", "--engine-arg", "tokenizer_mode=auto")
    assert build_model(args) == "engine"
    want = {"tensor_parallel_size": 2, "max_model_len": 512, "enable_prefix_caching": False,
            "tokenizer_mode": "auto", "dtype": "auto" if torch.cuda.is_available() else "float32",
            "disable_log_stats": False, "served_model_name": str(tmp_path)}
    assert made == [(str(tmp_path), want)]
    # statistics on by default, as vLLM's server; --disable-log-stats as there; labelled with the served name
    quiet = engine_options(_args(str(tmp_path), "--engine", "vllm", "--disable-log-stats",
                                 "--served-model-name", "m"))
    assert quiet["disable_log_stats"] is True and quiet["served_model_name"] == "m"
    with pytest.raises(ValueError, match="need --engine vllm"):
        engine_options(_args("tiny-gpt2", "--disable-log-stats"))
    assert engine_options(_args("tiny-gpt2")) == {}
    with pytest.raises(ValueError, match="need --engine vllm"):
        engine_options(_args("tiny-gpt2", "--max-model-len", "64"))
    with pytest.raises(FileNotFoundError, match="model directory"):
        build_model(_args("tiny-gpt2", "--engine", "vllm"))
    with pytest.raises(ValueError, match="KEY=VALUE"):
        engine_options(_args(str(tmp_path), "--engine", "vllm", "--engine-arg", "oops"))


# ----------------------------------------------------------------------------- SmolLM2's chat template
@pytest.mark.smollm2
def test_smollm2_chat_template():
    from asyncinterp.models import smollm2
    lm = smollm2()
    srv = Live(Server(lm, api_keys=[KEY], name="smollm2"))
    try:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
            messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
            resp = c.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0)
            got = collect(c.chat.completions.create(model="smollm2", messages=messages, max_tokens=8,
                                                    temperature=0, stream=True))
    finally:
        srv.close()
    ids = chat_ids(lm, messages)
    assert lm.tokenizer.decode(ids).startswith("<|im_start|>")      # SmolLM2's own template
    local = lm.generate(ids, max_new_tokens=8)
    assert resp.choices[0].message.content == local.text == got["text"]
    assert "Paris" in local.text


# ----------------------------------------------------------------------------- vLLM engine
@pytest.fixture(scope="module")
def vllm_dir(tiny_dir):
    return tiny_dir


@pytest.fixture(scope="module")
def vllm_live(vllm_dir):
    from vllm_helpers import cli_engine
    torch.set_num_threads(THREADS)   # vLLM's CPU attention needs the thread count its engine was bound with
    vm = cli_engine(vllm_dir, "--disable-log-stats", "--served-model-name", "tiny-vllm")   # as the CLI builds it
    srv = Live(Server(vm, api_keys=[KEY], name="tiny-vllm", allow_code=True, max_wait_ms=2))
    try:
        yield vm, srv
    finally:
        srv.close()
        vm.close()


async def vllm_steer(m, factor: float = 1.0):
    tops = []
    async for step in m.steps():
        h = await m.model.layers[0].hidden
        h[..., : h.shape[-1] // 2].mul_(factor)
        top = int((await m.logits)[0].argmax())
        ai.serve.emit(top)
        tops.append(top)
    return tops


@pytest.mark.vllm
def test_disable_log_stats_leaves_vllm_families_out_of_metrics(vllm_live):
    """``--disable-log-stats``, as on vLLM's server: the engine records no statistics and ``/metrics`` has no
    ``vllm:*`` family, even after completions (and even if an earlier engine in this process left some in
    prometheus' global registry); ours are there."""
    import httpx
    vm, srv = vllm_live
    assert vm.llm_engine.log_stats is False
    with openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        c.completions.create(model="tiny-vllm", prompt="The quick brown fox", max_tokens=3, temperature=0)
    text = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert "asyncinterp_requests_total" in text and "vllm:" not in text


@pytest.mark.vllm
def test_gradient_code_on_vllm_is_refused_clearly(vllm_live):
    vm, srv = vllm_live
    source = ("import torch\nasync def sal(m):\n    h = await m.model.layers[0].hidden\n"
              "    return torch.autograd.grad(h.sum(), h)\n")
    with ai.serve.Client(srv.url, api_key=KEY, timeout=60) as c, \
            pytest.raises(ai.serve.RemoteError, match="gradients are not available on this server") as info:
        c.trace("The quick brown fox", source)
    assert info.value.status == 400 and "inference_mode" in str(info.value)


VLLM_CODE = """
async def flip(m, factor):
    async for step in m.steps():
        h = await m.model.layers[0].hidden
        h[..., : h.shape[-1] // 2].mul_(factor)
        await m.logits
    return factor
"""


@pytest.mark.vllm
def test_vllm_engine_behind_the_openai_endpoints(vllm_live):
    vm, srv = vllm_live
    srv.server.intervention("vllm_steer")(vllm_steer)
    prompt = "The quick brown fox jumps"
    with openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        plain = c.completions.create(model="tiny-vllm", prompt=prompt, max_tokens=6, temperature=0)
        body = {"asyncinterp": {"intervention": "vllm_steer", "params": {"factor": -3.0}}}
        steered = c.completions.create(model="tiny-vllm", prompt=prompt, max_tokens=6, temperature=0,
                                       extra_body=body)
        streamed = collect(c.completions.create(model="tiny-vllm", prompt=prompt, max_tokens=6, temperature=0,
                                                stream=True, extra_body=body))
        coded = c.completions.create(model="tiny-vllm", prompt=prompt, max_tokens=6, temperature=0,
                                     extra_body={"asyncinterp": {"code": VLLM_CODE, "params": {"factor": -3.0}}})
        chat = collect(c.chat.completions.create(model="tiny-vllm", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, temperature=0, stream=True))
        sampled = [c.completions.create(model="tiny-vllm", prompt=prompt, max_tokens=6, temperature=0.8, seed=3)
                   .choices[0].text for _ in range(2)]
        stop = steered.choices[0].text[3:6]
        stopped = c.completions.create(model="tiny-vllm", prompt=prompt, max_tokens=6, temperature=0, stop=[stop],
                                       extra_body=body)
    local_plain = vm.generate(prompt, max_new_tokens=6)
    local = vm.generate(prompt, functools.partial(vllm_steer, factor=-3.0), max_new_tokens=6)
    assert plain.choices[0].text == local_plain.text and plain.usage.completion_tokens == 6
    assert steered.choices[0].text == local.text != local_plain.text
    assert ext(steered)["result"] == local.result
    assert [e["value"] for e in ext(steered)["emitted"]] == local.result
    assert streamed["text"] == local.text and streamed["final"] == ext(steered)
    assert [e["value"] for e in streamed["emits"]] == local.result
    assert coded.choices[0].text == local.text and ext(coded)["result"] == -3.0   # submitted code edits too
    assert sampled[0] == sampled[1]                                                  # seeded sampling
    assert stopped.choices[0].text == local.text[:local.text.index(stop)] and stopped.choices[0].finish_reason == "stop"
    assert len(ext(stopped)["result"]) == stopped.usage.completion_tokens < 6      # the engine stopped there
    if vm.tokenizer.chat_template:
        ids = chat_ids(vm, [{"role": "user", "content": "Hi"}])
        assert chat["text"] == vm.generate(ids, max_new_tokens=4).text


EMIT_CODE = """
async def tell(m):
    from asyncinterp.serve import emit
    async for step in m.steps():
        h = await m.model.layers[0].hidden
        h[:, -1] += 2.0
        emit(int((await m.logits)[0].argmax()))
    return "ok"
"""


@pytest.mark.vllm
def test_cli_serves_a_vllm_engine_under_tensor_parallel_2(vllm_dir):
    """The real command line, with two tensor-parallel workers: endpoints, streaming, emits from the workers."""
    import os
    import subprocess
    import sys
    import time

    import httpx
    from test_serve_http import free_port
    port = free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "src"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "asyncinterp.serve.cli", vllm_dir, "--engine", "vllm",
                             "--port", str(port), "--api-key", KEY, "--served-model-name", "tiny",
                             "--tensor-parallel-size", "2", "--allow-code", "--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", timeout=300, interval=0.5)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120) as c:
            assert [m.id for m in c.models.list().data] == ["tiny"]
            resp = c.completions.create(model="tiny", prompt="The quick brown fox jumps", max_tokens=4,
                                        temperature=0, extra_body={"asyncinterp": {"intervention": "top_k",
                                                                                   "params": {"k": 2}}})
            assert resp.usage.completion_tokens == 4 and len(ext(resp)["result"]["ids"][0]) == 2
            from transformers import AutoTokenizer
            last = ext(resp)["result"]["ids"][0][0]       # top_k of the last step: its greedy token
            assert resp.choices[0].text.endswith(AutoTokenizer.from_pretrained(vllm_dir).decode([last]))
            got = collect(c.completions.create(model="tiny", prompt="The quick brown fox jumps", max_tokens=4,
                                               temperature=0, stream=True))
            assert got["text"] == resp.choices[0].text
            body = {"asyncinterp": {"code": EMIT_CODE}}
            steered = c.completions.create(model="tiny", prompt="The quick brown fox jumps", max_tokens=5,
                                           temperature=0, extra_body=body)
            live = collect(c.completions.create(model="tiny", prompt="The quick brown fox jumps", max_tokens=5,
                                                temperature=0, stream=True, extra_body=body))
            assert ext(steered)["result"] == "ok" and live["final"]["result"] == "ok"
            assert [e["value"] for e in live["emits"]] == [e["value"] for e in ext(steered)["emitted"]]
            assert len(live["emits"]) == 5 and live["text"] == steered.choices[0].text
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
