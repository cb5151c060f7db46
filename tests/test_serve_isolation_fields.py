"""Named edits and logprobs under process isolation answer exactly as the same server in one process.

The module starts the tiny GPT-2 behind two real uvicorn servers with the same weights, the same registered
intervention and the same edits (installed as the CLI's ``--edit`` options install them): one with
``isolation="thread"`` (the model runs in the server's process) and one with ``ProcessIsolation`` (the model,
the edits and every intervention run in a worker process forked from the server, as ``asyncinterp serve
--allow-code`` runs them). Every request goes to both through the official ``openai`` package, greedy, and
the answers must be equal (log-probabilities to 1e-5): an edit chosen by model name, an edit with the
request's own intervention, ``logprobs``/``top_logprobs``, ``echo`` with logprobs, ``n`` > 1 and prompt
lists, streamed logprobs, edits with submitted code (run by the worker of submitted code). Also: an edit
installed after the workers started (the worker is replaced), and an edit that kills its worker (a clear
500 saying so, and the server serves on).
"""

import math
import os
import pickle
import textwrap
from multiprocessing import reduction
from typing import Annotated

import openai
import pytest

from asyncinterp.serve import Server
from asyncinterp.serve.http.app import Range
from asyncinterp.serve.openai.model_names import install_from_options, load_edit_function
from asyncinterp.serve.workers.supervisor import ProcessIsolation
from test_serve_http import Live
from serve_helpers import model, one_thread  # noqa: F401 - fixtures are found by name

pytestmark = pytest.mark.slow

KEY = "isolation-fields-key"
NAME = "tiny-gpt2"
N = 5
PROMPT = "Once upon a time"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")

EDITS_FILE = '''
async def up(m):
    """Shift half of block 0's output features (every forward pass)."""
    h = await m.transformer.h[0].output
    h[..., :16] += 3.0

async def flip(m):
    h = await m.transformer.h[1].output
    h.mul_(-1.0)
'''


TOP = """
async def f(m, layer):
    h = await m.transformer.h[layer].output
    return [round(float(v), 4) for v in h[0, -1, :4]]
"""


async def scale(m, layer: Annotated[int, Range(0, 1)], factor: Annotated[float, Range(-100, 100)] = 1.0):
    """A registered intervention (every step): scale block ``layer``'s first half; returns the top tokens."""
    tops = []
    async for _ in m.steps():
        h = await m.transformer.h[layer].output
        h[..., : h.shape[-1] // 2].mul_(factor)
        tops.append(int((await m.lm_head.output)[0, -1].argmax()))
    return tops


async def crash(m):
    """Trusted server code that kills its process (SIGABRT), as heap corruption would."""
    await m.transformer.h[0].output
    os.abort()


def make(model, edits_file, isolation):
    server = Server(model, api_keys=[KEY], name=NAME, timeout=60, max_wait_ms=2, isolation=isolation, allow_code=True,
                    code_budget=5.0)
    server.intervention("scale")(scale)
    install_from_options(server, [f"up={edits_file}:up", f"flip={edits_file}:flip", "half=scale:layer=1,factor=0.25"])
    return server


@pytest.fixture(scope="module")
def servers(model, tmp_path_factory):
    model.tokenizer.chat_template = CHAT_TEMPLATE
    path = tmp_path_factory.mktemp("edits") / "edits.py"
    path.write_text(textwrap.dedent(EDITS_FILE))
    isolated = make(model, str(path), ProcessIsolation(hang_timeout=5.0))
    isolated.add_edit("crash", crash)
    isolated.batcher.start()                  # the workers fork now, with the edits installed (as the CLI does)
    live = []
    try:
        live.append(Live(make(model, str(path), "thread")))
        live.append(Live(isolated))
        with openai.OpenAI(base_url=live[0].url + "/v1", api_key=KEY, max_retries=0, timeout=60) as ref, \
                openai.OpenAI(base_url=live[1].url + "/v1", api_key=KEY, max_retries=0, timeout=60) as iso:
            yield ref, iso, isolated, str(path)
    finally:
        for srv in live:
            srv.close()
        if len(live) < 2:
            isolated.batcher.close()


def plain(resp):
    """An answer without what differs between any two answers (id, creation time)."""
    out = resp.to_dict()
    for key in ("id", "created"):
        out.pop(key, None)
    return out


def close(a, b, path="answer"):
    """``a == b`` but floats to 1e-5 (log-probabilities); names the first difference."""
    if isinstance(a, float) and isinstance(b, (int, float)):
        assert math.isclose(a, b, rel_tol=0, abs_tol=1e-5), f"{path}: {a} != {b}"
    elif isinstance(a, dict) and isinstance(b, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), f"{path}: {len(a)} items != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            close(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def both(servers, create, **kw):
    """The same request to both servers: ``(thread server's answer, process server's answer)``, checked equal."""
    ref, iso = servers[0], servers[1]
    want, got = plain(create(ref, **kw)), plain(create(iso, **kw))
    close(got, want)
    return want, got


def completion(c, **kw):
    kw.setdefault("model", NAME)
    kw.setdefault("max_tokens", N)
    kw.setdefault("temperature", 0)
    return c.completions.create(prompt=kw.pop("prompt", PROMPT), **kw)


def chat(c, **kw):
    kw.setdefault("model", NAME)
    kw.setdefault("max_tokens", N)
    kw.setdefault("temperature", 0)
    return c.chat.completions.create(messages=[{"role": "user", "content": "Tell me a story"}], **kw)


# ----------------------------------------------------------------------------- named edits
def test_an_edit_chosen_by_model_name(servers):
    base, _ = both(servers, completion)
    for name in ("up", "half", "up+flip"):
        want, _ = both(servers, completion, model=f"{NAME}:{name}")
        assert want["choices"][0]["text"] != base["choices"][0]["text"]      # the edit did change the answer
        assert want["asyncinterp"]["receipt"]["edits"][0]["name"] == name.split("+")[0]
    both(servers, chat, model=f"{NAME}:flip")


def test_an_edit_with_the_requests_own_intervention(servers):
    own = {"asyncinterp": {"intervention": "scale", "params": {"layer": 0, "factor": -2.0}}}
    want, _ = both(servers, completion, model=f"{NAME}:up", extra_body=own)
    alone, _ = both(servers, completion, extra_body=own)
    assert want["asyncinterp"]["result"] != alone["asyncinterp"]["result"]   # it saw the edited model
    code = {"asyncinterp": {"code": TOP, "params": {"layer": 1}}}     # submitted code: the code worker runs the edit
    want, _ = both(servers, completion, model=f"{NAME}:up+flip", logprobs=2, extra_body=code)
    alone, _ = both(servers, completion, logprobs=2, extra_body=code)
    assert want["asyncinterp"]["result"] != alone["asyncinterp"]["result"]


# ----------------------------------------------------------------------------- logprobs
def test_logprobs_and_top_logprobs(servers, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the server unpickled something")
    for owner in (pickle, reduction.ForkingPickler):     # the log-probabilities cross as msgpack
        monkeypatch.setattr(owner, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    want, _ = both(servers, completion, logprobs=5)
    lp = want["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == N and all(len(top) in (5, 6) for top in lp["top_logprobs"])
    both(servers, completion, model=f"{NAME}:up", logprobs=3,
         extra_body={"asyncinterp": {"intervention": "scale", "params": {"layer": 1, "factor": 0.5}}})
    want, _ = both(servers, chat, logprobs=True, top_logprobs=5)
    assert len(want["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 5


def test_echo_with_logprobs(servers):
    want, _ = both(servers, completion, echo=True, logprobs=2, max_tokens=0)     # the prompt's log-likelihood
    lp = want["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    assert want["choices"][0]["text"] == PROMPT
    both(servers, completion, echo=True, logprobs=1, model=f"{NAME}:half")


def test_several_choices_and_prompt_lists(servers):
    want, _ = both(servers, completion, n=2, temperature=1.0, seed=11, logprobs=2)
    assert [c["index"] for c in want["choices"]] == [0, 1]
    assert want["choices"][0]["text"] != want["choices"][1]["text"]          # seeds 11 and 12
    want, _ = both(servers, completion, model=f"{NAME}:up", prompt=[PROMPT, "The quick brown"], n=2,
                   temperature=0.8, seed=3, echo=True, logprobs=1)
    assert len(want["choices"]) == 4
    want, _ = both(servers, completion, model=f"{NAME}:half", prompt=[PROMPT, "The quick brown"], logprobs=2)
    assert len(want["choices"]) == 2


def test_streamed_logprobs(servers):
    def streamed(c, **kw):
        chunks = [ch.to_dict() for ch in completion(c, stream=True, logprobs=3, model=f"{NAME}:flip", **kw)]
        return [{k: v for k, v in ch.items() if k not in ("id", "created")} for ch in chunks]
    ref, iso = servers[0], servers[1]
    want, got = streamed(ref), streamed(iso)
    close(got, want)
    assert sum(len(ch["choices"][0]["logprobs"]["tokens"]) for ch in want if ch["choices"]
               and ch["choices"][0].get("logprobs")) == N


# ----------------------------------------------------------------------------- workers come and go
def test_an_edit_installed_after_the_workers_started(servers):
    ref, iso, isolated, path = servers
    restarts = isolated.batcher.stats["restarts"]
    isolated.add_edit("late", load_edit_function(path, "flip"))
    got = completion(iso, model=f"{NAME}:late")
    assert got.choices[0].text == completion(ref, model=f"{NAME}:flip").choices[0].text
    assert isolated.batcher.stats["restarts"] == restarts     # replaced as stale, not counted as a failure
    assert isolated.batcher.health()["workers"]["trusted"]["ready"]


def test_an_edit_that_kills_its_worker_gets_a_clear_error(servers):
    iso, isolated = servers[1], servers[2]
    with pytest.raises(openai.InternalServerError) as info:
        completion(iso, model=f"{NAME}:crash")
    assert info.value.status_code == 500
    assert "SIGABRT" in info.value.body["message"], info.value.body
    assert isolated.batcher.stats["crashed"] >= 1
    assert completion(iso, logprobs=1).choices[0].logprobs.token_logprobs[0] < 0   # and it serves on
