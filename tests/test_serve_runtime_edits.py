"""Named edits registered at run time (``POST/GET/DELETE /v1/edits``) through a real server subprocess.

The workflow of a researcher with a shared server: compute a steering vector, register it as a named
edit (admin key), evaluate it by model name through the OpenAI endpoint with the stock ``openai`` client,
replace it (its hash and prefix-cache scope change; a request already running keeps the version it
started with), retire it (its model name is then a clear 404), and find it again after a restart. A
non-admin key is refused. Answers under an edit are compared with an independent reference: the same
model run by transformers with a hand-written forward hook.
"""

import json
import threading

import httpx
import openai
import pytest
import torch

from asyncinterp.models import tiny
from batch_helpers import EXACT, CliServer
from serve_helpers import one_thread  # noqa: F401 - fixtures are found by name

MODEL, USER, ADMIN = "tiny-gpt2", "edits-user", "edits-admin"
PROMPT = "The weather today is"
N = 8

SLOW_EDIT = '''
import time

SHIFT = {shift}

async def slow(m):
    """Shift block 0's first features, slowly (each pass waits 40 ms): a request under it runs for a while."""
    h = await m.transformer.h[0].output
    time.sleep(0.04)
    h[..., :16] += SHIFT
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = CliServer(MODEL, ["--api-key", USER, "--admin-key", ADMIN, "--edit", "calm=ablate:module=transformer.h.1",
                          *EXACT], tmp_path_factory.mktemp("state"))
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference():
    return tiny("gpt2")


def hidden(out):
    """A block's hidden states (a tensor, or the first of a tuple in older transformers)."""
    return out[0] if isinstance(out, tuple) else out


def block0(lm, prompt):
    """Block 0's output at the last position (a hand-written hook on the transformers model)."""
    seen = []
    handle = lm.module.transformer.h[0].register_forward_hook(lambda mod, args, out: seen.append(hidden(out)[0, -1]))
    with torch.no_grad():
        lm.module(**lm.tokenizer(prompt, return_tensors="pt"))
    handle.remove()
    return seen[0].clone()


def steered_text(lm, vector, strength):
    """Greedy text with ``strength * vector`` added to block 0's output at every position (transformers + hook)."""
    def hook(mod, args, out):
        hidden(out).add_(strength * vector)
    handle = lm.module.transformer.h[0].register_forward_hook(hook)
    try:
        ids = lm.tokenizer(PROMPT, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = lm.module.generate(ids, max_new_tokens=N, do_sample=False, pad_token_id=0)
    finally:
        handle.remove()
    return lm.tokenizer.decode(out[0, ids.shape[1]:])


def edits(server, key, method="GET", body=None, name=None):
    """``/v1/edits`` (or ``/v1/edits/NAME``) with ``key``; the raw answer."""
    path = server.url + "/v1/edits" + (f"/{name}" if name else "")
    return httpx.request(method, path, headers={"Authorization": f"Bearer {key}"}, timeout=60,
                         **({"json": body} if body is not None else {}))


def complete(client, model, **extra):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0, **extra)


def test_compute_register_evaluate_replace_retire(server, reference):
    vector = block0(reference, "I love this, it is wonderful") - block0(reference, "I hate this, it is awful")
    spec = f"steer:module=transformer.h.0,strength=4,vector={json.dumps(vector.tolist())}"
    r = edits(server, ADMIN, "POST", {"name": "love", "spec": spec})
    assert r.status_code == 200, r.text
    v1 = r.json()
    assert (v1["name"], v1["version"], v1["model"]) == ("love", 1, f"{MODEL}:love") and v1["hash"].startswith("sha256:")
    client = server.client(USER)
    plain = complete(client, MODEL).choices[0].text
    under = complete(client, f"{MODEL}:love")                        # usable at once, by model name
    assert under.choices[0].text == steered_text(reference, vector, 4.0) != plain
    assert under.model_extra["asyncinterp"]["receipt"]["edits"] == [{"name": "love", "hash": v1["hash"]}]
    assert f"{MODEL}:love" in [m.id for m in client.models.list()]
    listed = {e["name"]: e for e in edits(server, USER).json()["data"]}
    assert listed["love"]["hash"] == v1["hash"] and listed["love"]["runtime"] and not listed["calm"]["runtime"]
    scope1 = listed["love"]["cache_scope"]

    # replace it: a new version, a new hash, a new prefix-cache scope, and the new answer
    r = edits(server, ADMIN, "POST", {"name": "love", "intervention": "steer",
                                       "params": {"module": "transformer.h.0", "strength": -4.0,
                                                  "vector": vector.tolist()}})
    v2 = r.json()
    assert r.status_code == 200 and v2["version"] == 2 and v2["hash"] != v1["hash"]
    listed = {e["name"]: e for e in edits(server, USER).json()["data"]}
    assert listed["love"]["hash"] == v2["hash"] and listed["love"]["cache_scope"] != scope1
    assert complete(client, f"{MODEL}:love").choices[0].text == steered_text(reference, vector, -4.0)

    # retire it: its model name is a clear 404 from then on
    assert edits(server, ADMIN, "DELETE", name="love").json() == {"name": "love", "object": "edit", "deleted": True}
    with pytest.raises(openai.NotFoundError, match="no edit named 'love'"):
        complete(client, f"{MODEL}:love")
    assert edits(server, ADMIN, "DELETE", name="love").status_code == 404
    assert "love" not in [e["name"] for e in edits(server, USER).json()["data"]]
    client.close()


def test_a_running_request_keeps_the_version_it_started_with(server):
    def register(shift):
        r = edits(server, ADMIN, "POST", {"name": "slow", "source": SLOW_EDIT.format(shift=shift), "function": "slow"})
        assert r.status_code == 200, r.text
        return r.json()["hash"]

    client = server.client(USER)
    h1 = register(3.0)
    first = client.completions.create(model=f"{MODEL}:slow", prompt=PROMPT, max_tokens=30, temperature=0, logprobs=1)
    chunks, started = [], threading.Event()

    def stream():
        for chunk in client.completions.create(model=f"{MODEL}:slow", prompt=PROMPT, max_tokens=30, temperature=0,
                                               logprobs=1, stream=True):
            chunks.append(chunk)
            started.set()
    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    h2 = register(-3.0)                      # replaced while the stream runs (30 passes of 40 ms)
    reader.join(60)
    assert not reader.is_alive() and h2 != h1
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    logprobs = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert len(chunks) > 3 and streamed == first.choices[0].text          # all of it under the first version
    assert logprobs == first.choices[0].logprobs.token_logprobs
    receipts = [c.model_extra["asyncinterp"]["receipt"] for c in chunks if (c.model_extra or {}).get("asyncinterp")]
    assert receipts[-1]["edits"] == [{"name": "slow", "hash": h1}]
    after = client.completions.create(model=f"{MODEL}:slow", prompt=PROMPT, max_tokens=30, temperature=0, logprobs=1)
    assert after.model_extra["asyncinterp"]["receipt"]["edits"] == [{"name": "slow", "hash": h2}]
    assert after.choices[0].logprobs.token_logprobs != first.choices[0].logprobs.token_logprobs    # the new version
    client.close()


def test_only_an_admin_key_changes_edits(server):
    for method, name, body in (("POST", None, {"name": "x", "spec": "ablate:module=transformer.h.0"}),
                               ("DELETE", "slow", {})):
        r = edits(server, USER, method, body or None, name=name)
        assert r.status_code == 403 and "admin key" in r.json()["error"]["message"]
    assert edits(server, "no-such-key").status_code == 401
    r = edits(server, ADMIN, "POST", {"name": "calm", "spec": "ablate:module=transformer.h.0"})
    assert r.status_code == 409 and "--edit" in r.json()["error"]["message"]     # named at start: not replaced here
    for bad, says in (({"name": "b", "spec": "nope:k=1"}, "no registered intervention named 'nope'"),
                      ({"name": "b", "source": "async def f(m):\n    pass\n", "function": "g"}, "defines no 'g'"),
                      ({"name": "b c", "spec": "ablate:module=transformer.h.0"}, "name must be"),
                      ({"name": "b", "spec": "steer:module=transformer.h.0,vector=[1, 2]"}, "vector")):
        r = edits(server, ADMIN, "POST", bad)
        assert r.status_code == 400 and says in r.json()["error"]["message"], (bad, r.text)


def test_registered_edits_survive_a_restart(server):
    client = server.client(USER)
    before = client.completions.create(model=f"{MODEL}:slow", prompt=PROMPT, max_tokens=5, temperature=0)
    listed = {e["name"]: e["hash"] for e in edits(server, USER).json()["data"]}
    client.close()
    server.kill()
    server.start()
    assert {e["name"]: e["hash"] for e in edits(server, USER).json()["data"]} == listed
    with server.client(USER) as client:
        again = client.completions.create(model=f"{MODEL}:slow", prompt=PROMPT, max_tokens=5, temperature=0)
    assert again.choices[0].text == before.choices[0].text
