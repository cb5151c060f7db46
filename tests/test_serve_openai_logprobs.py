"""``logprobs``, ``echo`` (prompt logprobs), a list of prompts, ``n`` > 1, ``ignore_eos``,
``include_stop_str_in_output``, ``skip_special_tokens`` and ``response_format``: our server against vLLM's own, through the ``openai`` package.

vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``, a subprocess) is started once for the
module on the bundled SmolLM2-135M (float32, eager, small KV cache): it is the reference. Ours runs over the
same weights on each engine in turn (``ours`` is a module fixture parametrised by engine, so at most vLLM's
server and one of ours live at once): plain requests must answer vLLM's text and logprobs (to 1e-3);
requests with a steering intervention must answer the logprobs of the in-process run of the same
intervention (``ai.LanguageModel.generate`` / ``ai.VLLM.generate`` with ``logprobs=``/``prompt_logprobs=``),
which differ from the plain ones.
"""

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

import asyncinterp as ai
from asyncinterp.serve import Server
from test_serve_http import Live, free_port
from vllm_helpers import ENGINE, require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.smollm2]

NAME = "smol"
TOL = 1e-3
PROMPTS = ["The capital of France is", "Water boils at a temperature of", "My favourite colour is"]
LAYER, AMOUNT = 12, 3.0


async def steer(m, amount: float = AMOUNT):
    """Add ``amount`` to the residual stream after one layer, at every position and step."""
    async for _ in m.steps():
        (await m.model.layers[LAYER].resid_post).add_(amount)


# ----------------------------------------------------------------------------- servers
@pytest.fixture(scope="module")
def smol_dir():
    require_vllm()
    from asyncinterp.models.hf.bundled import smollm2_dir
    return str(smollm2_dir())


@pytest.fixture(scope="module")
def ref(smol_dir):
    """vLLM's own OpenAI server on SmolLM2 (a subprocess), as an ``openai`` client."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", smol_dir, "--served-model-name",
           NAME, "--dtype", "float32", "--enforce-eager", "--seed", "0", "--max-model-len", "256",
           "--kv-cache-memory-bytes", str(64 << 20), "--host", "127.0.0.1", "--port", str(port),
           "--disable-uvicorn-access-log"]
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM's server exited with {proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("vLLM's server did not start in 300 s")
            time.sleep(0.5)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120) as c:
            yield c
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


@pytest.fixture(scope="module", params=["transformers", "vllm"])
def ours(request, smol_dir, ref):
    """``(engine, model, openai client)``: our server on one engine, with ``steer`` registered as "push"."""
    if request.param == "vllm":
        import torch
        threads = torch.get_num_threads()
        model = ai.VLLM(smol_dir, **dict(ENGINE, max_model_len=256))
        torch.set_num_threads(threads)
    else:
        model = ai.models.smollm2()
    srv = Server(model, name=NAME, max_wait_ms=2, timeout=120)
    srv.add_intervention("push", steer)
    live = Live(srv)
    try:
        with openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            yield request.param, model, c
    finally:
        live.close()
        if request.param == "vllm":
            model.close()


# ----------------------------------------------------------------------------- comparisons
def same_logprobs(got, want):
    """Two completions ``logprobs`` objects: the same tokens and offsets, log-probabilities within TOL."""
    assert got.tokens == want.tokens
    assert got.text_offset == want.text_offset
    for a, b in zip(got.token_logprobs, want.token_logprobs):
        assert (a is None) == (b is None) and (a is None or abs(a - b) < TOL), (a, b)
    for a, b in zip(got.top_logprobs, want.top_logprobs):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < TOL for k in a), (a, b)


def same_chat_logprobs(got, want):
    assert [c.token for c in got.content] == [c.token for c in want.content]
    for a, b in zip(got.content, want.content):
        assert abs(a.logprob - b.logprob) < TOL and a.bytes == b.bytes
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
        assert all(abs(x.logprob - y.logprob) < TOL for x, y in zip(a.top_logprobs, b.top_logprobs))


def both(ours, ref, **body):
    _, _, client = ours
    body = dict(model=NAME, temperature=0, **body)
    return client.completions.create(**body), ref.completions.create(**body)


def stream_choices(client, **body):
    """A streamed completion put back together: {index: (text, tokens, token_logprobs, finish_reason)}."""
    out = {}
    for chunk in client.completions.create(model=NAME, stream=True, **body):
        for c in chunk.choices:
            text, tokens, lps, reason = out.get(c.index, ("", [], [], None))
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                lps += c.logprobs.token_logprobs
            out[c.index] = (text, tokens, lps, c.finish_reason or reason)
    return out


def close(a, b):
    return len(a) == len(b) and all((x is None and y is None) or abs(x - y) < TOL for x, y in zip(a, b))


# ----------------------------------------------------------------------------- plain requests equal vLLM's
@pytest.mark.parametrize("k", [0, 5])
def test_completion_logprobs_equal_vllm(ours, ref, k):
    got, want = both(ours, ref, prompt=PROMPTS[0], max_tokens=8, logprobs=k)
    assert got.choices[0].text == want.choices[0].text
    assert got.choices[0].finish_reason == want.choices[0].finish_reason
    same_logprobs(got.choices[0].logprobs, want.choices[0].logprobs)
    assert all(len(t) in (k, k + 1) for t in got.choices[0].logprobs.top_logprobs)


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_scores_a_list_of_prompts_as_vllm(ours, ref, max_tokens):
    """The log-likelihood pattern of evaluation harnesses: echo, logprobs, several prompts in one request."""
    got, want = both(ours, ref, prompt=PROMPTS, max_tokens=max_tokens, echo=True, logprobs=1)
    assert [c.index for c in got.choices] == [0, 1, 2]
    for g, w in zip(got.choices, want.choices):
        assert g.text == w.text and g.finish_reason == w.finish_reason
        same_logprobs(g.logprobs, w.logprobs)
        assert g.logprobs.token_logprobs[0] is None and g.logprobs.top_logprobs[0] is None
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert got.usage.completion_tokens == want.usage.completion_tokens
    # streamed: the same text and logprobs per choice
    streamed = stream_choices(ours[2], prompt=PROMPTS, max_tokens=max_tokens, echo=True, logprobs=1, temperature=0)
    for w in want.choices:
        text, tokens, lps, reason = streamed[w.index]
        assert text == w.text and tokens == w.logprobs.tokens and reason == w.finish_reason
        assert close(lps, w.logprobs.token_logprobs)


def test_chat_logprobs_equal_vllm(ours, ref):
    _, _, client = ours
    body = dict(model=NAME, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=6, temperature=0,
                logprobs=True, top_logprobs=3)
    got, want = client.chat.completions.create(**body), ref.chat.completions.create(**body)
    assert got.choices[0].message.content == want.choices[0].message.content
    same_chat_logprobs(got.choices[0].logprobs, want.choices[0].logprobs)
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **body):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed += c.logprobs.content
    assert [c.token for c in streamed] == [c.token for c in want.choices[0].logprobs.content]
    assert close([c.logprob for c in streamed], [c.logprob for c in want.choices[0].logprobs.content])


def test_streamed_logprobs_equal_vllm_streamed(ours, ref):
    body = dict(prompt=PROMPTS[1], max_tokens=8, logprobs=2, temperature=0)
    got, want = stream_choices(ours[2], **body), stream_choices(ref, **body)
    assert got[0][0] == want[0][0] and got[0][1] == want[0][1] and got[0][3] == want[0][3]
    assert close(got[0][2], want[0][2])


def test_n_samples_and_prompt_lists(ours, ref):
    engine, _, client = ours
    body = dict(prompt=PROMPTS[:2], max_tokens=6, temperature=1.0, seed=7, n=2)
    got = client.completions.create(model=NAME, **body)
    want = ref.completions.create(model=NAME, **body)
    assert [c.index for c in got.choices] == [c.index for c in want.choices] == [0, 1, 2, 3]
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert len({c.text for c in got.choices}) > 1
    # sample i of a seeded request is the request with seed + i alone (vLLM's rule), on both engines
    counted = 0
    for c in got.choices:
        alone = client.completions.create(model=NAME, prompt=PROMPTS[c.index // 2], max_tokens=6,
                                          temperature=1.0, seed=7 + c.index % 2)
        assert alone.choices[0].text == c.text
        counted += alone.usage.completion_tokens
    assert got.usage.completion_tokens == counted
    if engine == "vllm":     # the same engine samples the same tokens as vLLM's server (transformers draws otherwise)
        assert [c.text for c in got.choices] == [c.text for c in want.choices]
        assert got.usage.completion_tokens == want.usage.completion_tokens
    streamed = stream_choices(client, **body)
    assert {i: v[0] for i, v in streamed.items()} == {c.index: c.text for c in got.choices}
    greedy, want_greedy = both(ours, ref, prompt=PROMPTS, max_tokens=5)
    assert [c.text for c in greedy.choices] == [c.text for c in want_greedy.choices]


def test_stop_strings_ignore_eos_and_special_tokens_as_vllm(ours, ref):
    _, model, _ = ours
    eos = model.tokenizer.eos_token_id
    cases = [dict(stop=["."], include_stop_str_in_output=True), dict(stop=["."]),
             dict(logit_bias={str(eos): 100}, ignore_eos=True),
             dict(logit_bias={str(eos): 100}, ignore_eos=True, skip_special_tokens=False),
             dict(logit_bias={str(eos): 100}, min_tokens=2, skip_special_tokens=False)]
    for fields in cases:
        got, want = both(ours, ref, prompt=PROMPTS[0], max_tokens=6, extra_body=fields, logprobs=1)
        g, w = got.choices[0], want.choices[0]
        assert (g.text, g.finish_reason) == (w.text, w.finish_reason), fields
        assert got.usage.completion_tokens == want.usage.completion_tokens, fields
        same_logprobs(g.logprobs, w.logprobs)


def test_response_format_json_schema(ours, ref):
    engine, _, client = ours
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    body = dict(model=NAME, prompt="Give me a JSON object with a name:", max_tokens=20, temperature=0,
                extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    want = ref.completions.create(**body)
    if engine == "vllm":
        got = client.completions.create(**body)
        assert got.choices[0].text == want.choices[0].text and want.choices[0].text.lstrip().startswith("{")
    else:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(**body)
        assert err.value.body["param"] == "response_format" and "--engine vllm" in err.value.body["message"]


# ----------------------------------------------------------------------------- under an intervention
def test_intervened_logprobs_equal_the_in_process_run(ours, ref):
    engine, model, client = ours
    ext = {"asyncinterp": {"intervention": "push", "params": {"amount": AMOUNT}}}
    got = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=5,
                                    echo=True, extra_body=ext).choices[0]
    plain = ref.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=5,
                                   echo=True).choices[0]
    local = model.generate(PROMPTS[0], steer, max_new_tokens=6, logprobs=5, prompt_logprobs=5)
    n_prompt = len(model.tokenizer(PROMPTS[0])["input_ids"])
    entries = list(local.prompt_logprobs) + list(local.logprobs)
    ids = model.tokenizer(PROMPTS[0])["input_ids"] + [int(t) for t in local.tokens]
    want = [None] + [entries[i][ids[i]] for i in range(1, len(ids))]
    assert close(got.logprobs.token_logprobs, want)
    assert got.text == PROMPTS[0] + local.text
    # the steering changed them: the prompt's (after the first tokens) and the answer's
    assert not close(got.logprobs.token_logprobs[:n_prompt], plain.logprobs.token_logprobs[:n_prompt])
    for i in range(1, len(ids)):
        top = got.logprobs.top_logprobs[i]
        for tid, lp in entries[i].items():
            assert abs(top[model.tokenizer.decode([tid])] - lp) < TOL
    # scoring alone (max_tokens=0), streamed too
    score = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=0,
                                      extra_body=ext).choices[0]
    assert close(score.logprobs.token_logprobs, want[:n_prompt])
    streamed = stream_choices(client, prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=0, extra_body=ext)
    assert streamed[0][0] == PROMPTS[0] and close(streamed[0][2], want[:n_prompt])
