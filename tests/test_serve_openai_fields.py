"""vLLM's sampling fields and vLLM's extra endpoints (``/tokenize``, ``/detokenize``, ``/version``, ``/metrics``),
called with the ``openai`` package (and ``httpx``) against live uvicorn servers.

One server per engine, started once for the module: a tiny GPT-2 on the transformers engine; for the
``vllm`` tests, an ``ai.VLLM`` engine and a transformers ``LanguageModel`` over the same tiny Llama weights,
each behind its own server, so that every field is checked on vLLM against its meaning and the same
request's greedy text is compared between the two engines.
"""

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncinterp.models import tiny
from asyncinterp.serve import Server
from serve_helpers import SPIN
from test_serve_http import Live
from vllm_helpers import tiny_dir  # noqa: F401 - fixtures are found by name

KEY = "fields-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The cat sat on the"


@pytest.fixture(scope="module")
def lm():
    return tiny("gpt2")


@pytest.fixture(scope="module")
def hf_live(lm):
    srv = Live(Server(lm, api_keys=[KEY], name="tiny", max_wait_ms=2, timeout=60))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(hf_live):
    with openai.OpenAI(base_url=hf_live.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def complete(client, model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, **fields):
    resp = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                                     extra_body=fields or None)
    choice = resp.choices[0]
    return choice.text, resp.usage.completion_tokens, choice.finish_reason


def stream_text(client, model="tiny", prompt=PROMPT, max_tokens=8, **fields):
    text, reason = "", None
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, extra_body=fields or None):
        for choice in chunk.choices:
            text += choice.text or ""
            reason = choice.finish_reason or reason
    return text, reason


def token_ids(url, text):
    return httpx.post(url + "/tokenize", json={"prompt": text}, headers=AUTH).json()["tokens"]


def scrape(url) -> dict:
    """``/metrics`` parsed with prometheus_client's own parser: ``{(sample name, labels): value}``."""
    resp = httpx.get(url + "/metrics", headers=AUTH)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# ----------------------------------------------------------------------------- transformers engine
def test_logit_bias_forces_a_token(client, lm):
    tid = token_ids(client.base_url.__str__().removesuffix("/v1/"), " the")[0]
    text, n, _ = complete(client, logit_bias={str(tid): 100})
    assert text == lm.tokenizer.decode([tid] * 8) and n == 8
    plain, _, _ = complete(client, logit_bias={str(tid): -100})
    assert " the" not in plain


def test_min_tokens_holds_back_the_end_of_sequence(client, lm):
    eos = lm.tokenizer.eos_token_id
    assert complete(client, logit_bias={str(eos): 100}) == ("", 1, "stop")           # eos at once
    text, n, reason = complete(client, logit_bias={str(eos): 100}, min_tokens=3)
    assert n == 4 and reason == "stop" and text == complete(client, max_tokens=3)[0]  # 3 tokens, then eos
    # the end-of-sequence token's own text: only with skip_special_tokens=false and include_stop_str_in_output
    shown, _, _ = complete(client, logit_bias={str(eos): 100}, min_tokens=3, skip_special_tokens=False,
                           include_stop_str_in_output=True)
    assert shown == text + lm.tokenizer.eos_token


def test_ignore_eos_runs_to_max_tokens_on_transformers(client, lm):
    eos = lm.tokenizer.eos_token_id
    forced = {"logit_bias": {str(eos): 100}}
    assert complete(client, **forced)[1:] == (1, "stop")
    text, n, reason = complete(client, ignore_eos=True, **forced)
    assert (n, reason) == (8, "length") and text == ""          # eight end-of-sequence tokens, not shown
    shown, _, _ = complete(client, ignore_eos=True, skip_special_tokens=False, **forced)
    assert shown == lm.tokenizer.eos_token * 8
    assert stream_text(client, ignore_eos=True, skip_special_tokens=False, **forced) == (shown, "length")


def test_stop_token_ids_end_the_answer_at_that_id(client, lm):
    # this tiny model repeats one token; a frequency penalty makes its greedy continuation varied
    pen = {"frequency_penalty": 2.0}
    local = [int(t) for t in lm.generate(PROMPT, max_new_tokens=8, **pen).tokens]
    stop = local[3]
    k = local.index(stop)
    assert k > 0
    text, n, reason = complete(client, stop_token_ids=[stop], **pen)
    assert n == k + 1 and reason == "stop" and text == lm.tokenizer.decode(local[:k])
    with_stop, n2, _ = complete(client, stop_token_ids=[stop], include_stop_str_in_output=True, **pen)
    assert n2 == n and with_stop == lm.tokenizer.decode(local[:k + 1])
    assert stream_text(client, stop_token_ids=[stop], **pen) == (text, "stop")


def test_include_stop_str_in_output_keeps_a_stop_string(client):
    pen = {"frequency_penalty": 2.0}
    plain, _, _ = complete(client, **pen)
    stop = plain[9:13]
    cut, _, reason = complete(client, stop=[stop], **pen)
    kept, _, _ = complete(client, stop=[stop], include_stop_str_in_output=True, **pen)
    assert reason == "stop" and cut == plain[:plain.index(stop)] and kept == cut + stop
    assert stream_text(client, stop=[stop], include_stop_str_in_output=True, **pen) == (kept, "stop")


@pytest.mark.parametrize("fields", [{"frequency_penalty": 2.0}, {"presence_penalty": 1.5},
                                    {"repetition_penalty": 1.8}, {"frequency_penalty": 0.7, "presence_penalty": -0.5}])
def test_penalties_change_a_repetitive_greedy_continuation_as_locally(client, lm, fields):
    plain, _, _ = complete(client, max_tokens=12)
    assert len(set(plain.split())) < len(plain.split())            # the plain continuation repeats itself
    text, _, _ = complete(client, max_tokens=12, **fields)
    assert text != plain
    assert text == lm.generate(PROMPT, max_new_tokens=12, **fields).text     # the same options, run directly


def test_seeded_sampling_with_top_k_and_min_p_is_reproducible(client):
    runs = [complete(client, max_tokens=10, temperature=1.0, seed=11, top_k=20, min_p=0.01)[0] for _ in range(2)]
    assert runs[0] == runs[1]
    # top_k=1 keeps only the most likely token: sampling gives the greedy text
    assert complete(client, max_tokens=10, temperature=1.0, seed=3, top_k=1)[0] == complete(client, max_tokens=10)[0]


def test_chat_takes_the_same_fields(client, lm):
    lm.tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    try:
        tid = token_ids(client.base_url.__str__().removesuffix("/v1/"), " the")[0]
        resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4, temperature=0, logit_bias={str(tid): 100},
                                              extra_body={"min_tokens": 2})
        assert resp.choices[0].message.content == lm.tokenizer.decode([tid] * 4)
        url = client.base_url.__str__().removesuffix("/v1/")
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
        got = httpx.post(url + "/tokenize", json={"messages": messages}, headers=AUTH).json()
        want = lm.tokenizer(lm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)["input_ids"]
        assert got["tokens"] == want and got["count"] == len(want)
        refused = httpx.post(url + "/tokenize", json={"messages": messages, "tools": []}, headers=AUTH)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"
    finally:
        lm.tokenizer.chat_template = None


@pytest.mark.parametrize("fields,param", [({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p"),
                                          ({"min_tokens": 9}, "min_tokens"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                                          ({"logit_bias": {"99999999": 1}}, "logit_bias"),
                                          ({"stop_token_ids": [-1]}, "stop_token_ids"),
                                          ({"repetition_penalty": 0}, "repetition_penalty"),
                                          ({"presence_penalty": 3}, "presence_penalty"),
                                          ({"skip_special_tokens": "no"}, "skip_special_tokens")])
def test_invalid_field_values_are_400_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as err:
        complete(client, **fields)
    assert err.value.body["param"] == param


def test_tokenize_detokenize_round_trip(hf_live, lm):
    url = hf_live.url
    for text in (PROMPT, "Hello, world! 123", " spaced  out "):
        got = httpx.post(url + "/tokenize", json={"model": "tiny", "prompt": text, "return_token_strs": True},
                         headers=AUTH).json()
        ids = lm.tokenizer(text)["input_ids"]
        assert got == {"count": len(ids), "max_model_len": got["max_model_len"], "tokens": ids,
                       "token_strs": lm.tokenizer.convert_ids_to_tokens(ids)}
        back = httpx.post(url + "/detokenize", json={"tokens": ids}, headers=AUTH).json()
        assert back == {"prompt": lm.tokenizer.decode(ids)} and back["prompt"] == text
    bad = httpx.post(url + "/detokenize", json={"tokens": [-1]}, headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    wrong = httpx.post(url + "/tokenize", json={"model": "other", "prompt": "x"}, headers=AUTH)
    assert wrong.status_code == 404


def test_version_and_auth_on_the_extra_endpoints(hf_live):
    url = hf_live.url
    assert httpx.get(url + "/version", headers=AUTH).json()["version"]
    for method, path in (("GET", "/version"), ("GET", "/metrics"), ("POST", "/tokenize"), ("POST", "/detokenize")):
        resp = httpx.request(method, url + path, json={"prompt": "x", "tokens": [1]})
        assert resp.status_code == 401, path
        assert resp.json()["error"]["type"] == "authentication_error"


def test_metrics_count_the_requests_exactly(hf_live, client):
    before = scrape(hf_live.url)
    ok = (("endpoint", "completions"), ("status", "200"))
    bad = (("endpoint", "completions"), ("status", "400"))
    for _ in range(3):
        complete(client, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        complete(client, top_k=-5)
    after = scrape(hf_live.url)
    assert after[("asyncinterp_requests_total", ok)] - before.get(("asyncinterp_requests_total", ok), 0) == 3
    assert after[("asyncinterp_requests_total", bad)] - before.get(("asyncinterp_requests_total", bad), 0) == 1
    assert ("asyncinterp_queue_depth", ()) in after and ("asyncinterp_worker_restarts_total", ()) in after
    assert ("asyncinterp_sandbox_refusals_total", ()) in after and ("asyncinterp_budget_cuts_total", ()) in after


def test_metrics_scraped_during_a_load_run(hf_live, client):
    """Concurrent requests while /metrics is scraped: every scrape parses, the counter never goes back, and it
    ends moved by exactly the number of requests."""
    import concurrent.futures
    key = ("asyncinterp_requests_total", (("endpoint", "chat.completions"), ("status", "400")))
    ok = ("asyncinterp_requests_total", (("endpoint", "completions"), ("status", "200")))
    before = scrape(hf_live.url)
    n = 12
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        jobs = [pool.submit(complete, client, prompt=f"{PROMPT} {i}", max_tokens=6) for i in range(n)]
        seen = []
        while not all(j.done() for j in jobs):
            seen.append(scrape(hf_live.url).get(ok, 0))
        for j in jobs:
            j.result()
    after = scrape(hf_live.url)
    assert seen == sorted(seen) and after[ok] - before.get(ok, 0) == n
    assert after.get(key, 0) == before.get(key, 0)
    assert after[("asyncinterp_queue_depth", ())] == 0


def test_metrics_count_refusals_and_budget_cuts(lm):
    """A second server (its own registry: no collision with the first's counters)."""
    srv = Live(Server(lm, api_keys=[KEY], name="tiny", max_wait_ms=2, timeout=60, allow_code=True,
                      code_budget=0.3))
    try:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
            with pytest.raises(openai.BadRequestError):            # the sandbox refuses an import
                complete(c, asyncinterp={"code": "import os\nasync def f(m):\n    return 1\n"})
            with pytest.raises(openai.InternalServerError) as err:   # 504: past its compute budget
                complete(c, asyncinterp={"code": SPIN})
            assert err.value.status_code == 504
        after = scrape(srv.url)
        assert after[("asyncinterp_sandbox_refusals_total", ())] == 1
        assert after[("asyncinterp_budget_cuts_total", ())] == 1
        assert after[("asyncinterp_requests_total", (("endpoint", "completions"), ("status", "400")))] == 1
        assert after[("asyncinterp_requests_total", (("endpoint", "completions"), ("status", "504")))] == 1
    finally:
        srv.close()


def test_fields_reach_supervised_worker_processes(client, lm):
    """With process isolation the fields travel to the worker and give the same answers as in-process."""
    srv = Live(Server(lm, api_keys=[KEY], name="tiny", max_wait_ms=2, timeout=60, isolation="process"))
    eos = lm.tokenizer.eos_token_id
    cases = [{"frequency_penalty": 2.0, "stop_token_ids": [int(lm.generate(PROMPT, max_new_tokens=4,
                                                                          frequency_penalty=2.0).tokens[3])]},
             {"logit_bias": {str(eos): 100}, "min_tokens": 3}, {"repetition_penalty": 1.8, "presence_penalty": 1.0}]
    try:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
            for fields in cases:
                assert complete(c, **fields) == complete(client, **fields), fields
        assert scrape(srv.url)[("asyncinterp_worker_restarts_total", ())] == 0
    finally:
        srv.close()


# ----------------------------------------------------------------------------- vLLM engine
VLLM_PROMPT = "The quick brown fox jumps"


@pytest.fixture(scope="module")
def vllm_pair(tiny_dir):
    """Servers over the same tiny Llama: ``ai.VLLM`` and a transformers ``LanguageModel`` (vLLM's tokenizer)."""
    import torch

    import asyncinterp as ai
    from vllm_helpers import cli_engine, hf_model
    threads = torch.get_num_threads()
    vm = cli_engine(tiny_dir, "--served-model-name", "tiny")   # as `asyncinterp serve --engine vllm` builds it
    torch.set_num_threads(threads)   # vLLM's CPU attention needs the thread count its engine was bound with
    hf = ai.LanguageModel(hf_model(tiny_dir), vm.tokenizer)
    v_srv = Live(Server(vm, api_keys=[KEY], name="tiny", max_wait_ms=2, timeout=120))
    h_srv = Live(Server(hf, api_keys=[KEY], name="tiny", max_wait_ms=2, timeout=120))
    try:
        with openai.OpenAI(base_url=v_srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as vc, \
                openai.OpenAI(base_url=h_srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as hc:
            yield vm, v_srv, vc, hc
    finally:
        h_srv.close()
        v_srv.close()
        vm.close()


def vllm_reference(vm, prompt, max_tokens=8, **fields):
    """vLLM's own answer (its ``LLM.generate`` with these ``SamplingParams`` fields, greedy): text, tokens, reason."""
    from vllm import SamplingParams
    out = vm.llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, **fields),
                          use_tqdm=False)[0].outputs[0]
    return out.text, len(out.token_ids), out.finish_reason


@pytest.mark.vllm
@pytest.mark.parametrize("fields", [
    {}, {"min_tokens": 3, "logit_bias": {"EOS": 100}}, {"logit_bias": {"FIRST": 100}},
    {"logit_bias": {"FIRST": -100}}, {"stop_token_ids": ["FOURTH"], "frequency_penalty": 2.0},
    {"stop_token_ids": ["FOURTH"], "include_stop_str_in_output": True, "frequency_penalty": 2.0},
    {"frequency_penalty": 1.5}, {"presence_penalty": 1.0}, {"presence_penalty": -1.0, "frequency_penalty": 0.5},
    {"repetition_penalty": 1.6}, {"repetition_penalty": 0.7},
    {"logit_bias": {"EOS": 100}, "min_tokens": 2, "skip_special_tokens": False, "include_stop_str_in_output": True},
], ids=lambda f: "-".join(sorted(f)) or "plain")
def test_transformers_engine_answers_as_vllm_itself(vllm_pair, fields):
    """The transformers engine's server, given vLLM's fields, answers what vLLM itself generates for them."""
    vm, v_srv, vc, hc = vllm_pair
    tok = vm.tokenizer
    greedy = [int(t) for t in vllm_reference_ids(vm)]
    varied = [int(t) for t in vllm_reference_ids(vm, frequency_penalty=2.0)]   # this tiny model repeats itself
    names = {"EOS": tok.eos_token_id, "FIRST": greedy[0], "FOURTH": varied[3]}
    fields = {k: ({names.get(i, i): b for i, b in v.items()} if k == "logit_bias" else
                  [names.get(i, i) for i in v] if k == "stop_token_ids" else v) for k, v in fields.items()}
    want = vllm_reference(vm, VLLM_PROMPT, 10, **fields)
    wire = dict(fields)
    if "logit_bias" in wire:
        wire["logit_bias"] = {str(i): b for i, b in wire["logit_bias"].items()}
    got = complete(hc, prompt=VLLM_PROMPT, max_tokens=10, **wire)
    assert got == want
    if fields:
        assert stream_text(hc, prompt=VLLM_PROMPT, max_tokens=10, **wire) == (want[0], want[2])


def vllm_reference_ids(vm, **fields):
    from vllm import SamplingParams
    return vm.llm.generate([VLLM_PROMPT], SamplingParams(max_tokens=10, temperature=0.0, **fields),
                           use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.vllm
def test_vllm_fields_mean_what_vllm_says_and_equal_transformers(vllm_pair):
    vm, v_srv, vc, hc = vllm_pair
    tok = vm.tokenizer
    eos = tok.eos_token_id
    plain = complete(vc, prompt=VLLM_PROMPT, max_tokens=10)
    assert plain == complete(hc, prompt=VLLM_PROMPT, max_tokens=10) == vllm_reference(vm, VLLM_PROMPT, 10)
    local = [int(t) for t in vllm_reference_ids(vm)]
    tid = local[0]
    # logit_bias forces a token; min_tokens holds back the end; ignore_eos (vLLM only) runs to max_tokens
    forced = complete(vc, prompt=VLLM_PROMPT, logit_bias={str(tid): 100})
    assert forced == (tok.decode([tid] * 8), 8, "length") == complete(hc, prompt=VLLM_PROMPT,
                                                                          logit_bias={str(tid): 100})
    ended = complete(vc, prompt=VLLM_PROMPT, logit_bias={str(eos): 100}, min_tokens=3)
    assert ended[1:] == (4, "stop") and ended == complete(hc, prompt=VLLM_PROMPT, logit_bias={str(eos): 100},
                                                          min_tokens=3)
    assert complete(vc, prompt=VLLM_PROMPT, logit_bias={str(eos): 100}, ignore_eos=True)[1:] == (8, "length")
    # stop_token_ids end at that id (counted, its text left out unless include_stop_str_in_output)
    stop = [int(t) for t in vllm_reference_ids(vm, frequency_penalty=2.0)][3]
    for fields in ({"stop_token_ids": [stop], "frequency_penalty": 2.0},
                   {"stop_token_ids": [stop], "include_stop_str_in_output": True, "frequency_penalty": 2.0}):
        got = complete(vc, prompt=VLLM_PROMPT, max_tokens=10, **fields)
        assert got == vllm_reference(vm, VLLM_PROMPT, 10, **fields)
        assert stream_text(vc, prompt=VLLM_PROMPT, max_tokens=10, **fields) == (got[0], "stop")
    for fields in ({"frequency_penalty": 1.5}, {"presence_penalty": 1.0}, {"repetition_penalty": 1.6}):
        assert complete(vc, prompt=VLLM_PROMPT, max_tokens=10, **fields) == vllm_reference(
            vm, VLLM_PROMPT, 10, **fields), fields
    # seeded sampling with top_k and min_p: reproducible; top_k=1 is greedy
    runs = [complete(vc, prompt=VLLM_PROMPT, temperature=1.0, seed=5, top_k=20, min_p=0.01)[0] for _ in range(2)]
    assert runs[0] == runs[1]
    assert complete(vc, prompt=VLLM_PROMPT, max_tokens=10, temperature=1.0, seed=5, top_k=1)[0] == plain[0]


@pytest.mark.vllm
def test_vllm_extra_endpoints_and_metrics(vllm_pair):
    vm, v_srv, vc, hc = vllm_pair
    url = v_srv.url
    import vllm
    assert httpx.get(url + "/version", headers=AUTH).json()["version"] == vllm.__version__
    got = httpx.post(url + "/tokenize", json={"prompt": VLLM_PROMPT}, headers=AUTH).json()
    ids = vm.tokenizer(VLLM_PROMPT)["input_ids"]
    assert got["tokens"] == ids and got["count"] == len(ids) and got["max_model_len"] == vm.max_model_len
    assert httpx.post(url + "/detokenize", json={"tokens": ids}, headers=AUTH).json() == {
        "prompt": vm.tokenizer.decode(ids)}
    before = scrape(url)
    ok = ("asyncinterp_requests_total", (("endpoint", "completions"), ("status", "200")))
    generated = sum(complete(vc, prompt=VLLM_PROMPT, max_tokens=2)[1] for _ in range(4))
    after = scrape(url)
    assert after[ok] - before.get(ok, 0) == 4
    # vLLM's own families, as its server shows them (statistics on by default, labelled with the served name)
    label = (("engine", "0"), ("model_name", "tiny"))
    assert ("vllm:num_requests_running", label) in after and ("vllm:kv_cache_usage_perc", label) in after
    assert after[("vllm:prompt_tokens_total", label)] - before.get(("vllm:prompt_tokens_total", label), 0) == 4 * len(ids)
    assert after[("vllm:generation_tokens_total", label)] - before.get(("vllm:generation_tokens_total", label), 0) == generated
    assert sum(v for (name, labels), v in after.items() if name == "vllm:request_success_total") >= 4
    ttft = ("vllm:time_to_first_token_seconds_count", label)
    assert after[ttft] - before.get(ttft, 0) == 4 and after[("vllm:time_to_first_token_seconds_sum", label)] > 0
    assert after[("vllm:e2e_request_latency_seconds_count", label)] >= 4


@pytest.mark.vllm
def test_vllm_metrics_are_the_families_vllms_own_server_shows(vllm_pair):
    """Every family vLLM's own server would render at ``/metrics`` (its stat loggers' registry: the same
    ``PrometheusStatLogger`` records here) is in ours, under the same name and type: dashboards work unchanged."""
    from prometheus_client import generate_latest
    from vllm.v1.metrics.prometheus import get_prometheus_registry
    vm, v_srv, vc, hc = vllm_pair
    assert vm.llm_engine.log_stats is True
    complete(vc, prompt=VLLM_PROMPT, max_tokens=2)
    rendered = generate_latest(get_prometheus_registry()).decode()   # what vLLM's server answers at /metrics
    theirs = {(f.name, f.type) for f in text_string_to_metric_families(rendered) if f.name.startswith("vllm:")}
    resp = httpx.get(v_srv.url + "/metrics", headers=AUTH)
    ours = {(f.name, f.type) for f in text_string_to_metric_families(resp.text) if f.name.startswith("vllm:")}
    assert theirs and ours == theirs
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens",
                 "vllm:generation_tokens", "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_success", "vllm:kv_cache_usage_perc"):
        assert name in {n for n, _ in ours}, name


@pytest.mark.vllm
def test_vllm_engine_options_are_sampling_params(tiny_dir):
    """What the vLLM front hands the engine for every field is a valid ``SamplingParams`` with vLLM's meaning
    (the path the engine takes: ``run.invoke(prompt, **options)`` -> ``SamplingParams(**options)``)."""
    from vllm import SamplingParams

    from asyncinterp.models.vllm.requests import sampling_kwargs as _sampling_kwargs
    from asyncinterp.serve import openai_compat
    from asyncinterp.serve.scheduling.engine_front import VLLMFront
    body = {"model": "m", "prompt": "x", "max_tokens": 8, "temperature": 0.7, "seed": 3, "top_k": 5, "min_p": 0.1,
            "min_tokens": 2, "ignore_eos": True, "repetition_penalty": 1.2, "presence_penalty": 0.5,
            "frequency_penalty": -0.5, "logit_bias": {"7": 200}, "stop_token_ids": [9, 9, 11],
            "include_stop_str_in_output": True, "skip_special_tokens": False}
    req = openai_compat.parse_request("completions", body, {}, vocab=100)
    options = {**req.generate, **VLLMFront.sampling_options(None, req.fields)}
    params = SamplingParams(**_sampling_kwargs(options, 8))
    assert (params.top_k, params.min_p, params.min_tokens, params.ignore_eos, params.seed) == (5, 0.1, 2, True, 3)
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.2, 0.5, -0.5)
    assert params.logit_bias == {7: 100.0} and params.stop_token_ids == [9, 11] and params.temperature == 0.7
    assert params.include_stop_str_in_output and not params.skip_special_tokens
