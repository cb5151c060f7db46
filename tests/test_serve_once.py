"""Each request does each thing once (issue 30): one tokenization per prompt, one ``Job`` per process that runs
it, and on vLLM one set of sampling parameters and one adapter request.

The counters wrap the real functions (the tokenizer's encoding, ``Job``'s constructor, vLLM's
``SamplingParams``) for the duration of one request through a real server, from the HTTP body to the answer.
"""

import contextlib
import functools
import threading

import openai
import pytest
import torch

import asyncinterp as ai
from asyncinterp import job as job_module
from asyncinterp.serve import Server
from serve_helpers import one_thread  # noqa: F401 - fixtures are found by name
from test_serve_http import Live
from vllm_helpers import tiny_dir  # noqa: F401 - fixtures are found by name

KEY = "once"
OTHER_KEY = "another tenant"
PROMPT = "The quick brown fox jumps over the"


@contextlib.contextmanager
def counting(tokenizer):
    """Counts of tokenizations (by ``tokenizer``'s class: every instance of it, the engine's too) and of ``Job``
    constructions. A tokenization is an outermost call of ``__call__``, ``encode`` or ``apply_chat_template``
    (they call each other: a nested call is part of the same tokenization)."""
    counts = {"tokenize": 0, "job": 0}
    cls = type(tokenizer)
    depth = threading.local()
    saved = {name: cls.__dict__.get(name) for name in ("__call__", "encode", "apply_chat_template")}

    def wrap(name):
        real = getattr(cls, name)

        @functools.wraps(real)
        def counted(self, *a, **kw):
            outer = not getattr(depth, "n", 0)
            counts["tokenize"] += outer
            depth.n = getattr(depth, "n", 0) + 1
            try:
                return real(self, *a, **kw)
            finally:
                depth.n -= 1
        return counted

    new_job = job_module.Job.__new__

    def counted_job(cls_, *a, **kw):
        counts["job"] += 1
        return new_job(cls_, *a, **kw)

    for name in saved:
        setattr(cls, name, wrap(name))
    job_module.Job.__new__ = counted_job
    try:
        yield counts
    finally:
        for name, real in saved.items():
            if real is None:
                delattr(cls, name)
            else:
                setattr(cls, name, real)
        job_module.Job.__new__ = new_job


@pytest.fixture(scope="module")
def lm():
    return ai.models.tiny("gpt2")


@pytest.fixture(scope="module")
def live(lm):
    srv = Live(Server(lm, api_keys=[KEY, OTHER_KEY], allow_code=True))
    yield srv
    srv.close()


def test_one_openai_completion_on_transformers_tokenizes_once_and_makes_one_job(lm, live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        c.completions.create(model=live.server.name, prompt="warm up", max_tokens=2, temperature=0)
        with counting(lm.tokenizer) as counts:
            resp = c.completions.create(model=live.server.name, prompt=PROMPT, max_tokens=3, temperature=0,
                                        logprobs=1, echo=True)
    assert resp.choices[0].text == PROMPT + lm.tokenizer.decode(lm.generate(PROMPT, max_new_tokens=3).tokens)
    assert counts == {"tokenize": 1, "job": 1}, counts


def test_one_remote_trace_tokenizes_once_and_makes_one_job(lm, live):
    remote = ai.remote(live.url, api_key=KEY)

    async def read(m):
        return (await m.lm_head.output)[:, -1].clone()
    remote.trace("warm up", read)
    with counting(lm.tokenizer) as counts:
        got = remote.trace(PROMPT, read)
    want = lm.trace(PROMPT, read)
    assert torch.allclose(got, want, atol=1e-5)
    # the client's own Job (it builds the job it sends) and the server's: one per process
    assert counts == {"tokenize": 1, "job": 2}, counts


def test_a_jobs_prompts_are_tokenized_together_once_each(lm, live):
    remote = ai.remote(live.url, api_key=KEY)
    first = "A first prompt of this test, never sent before"
    other = "A second prompt, several tokens longer than the first one"

    async def read(m):
        return (await m.lm_head.output)[:, -1].clone()

    def three(model):      # two prompts, one of them twice
        with model.trace() as tr:
            calls = [tr.invoke(x, read) for x in (first, other, first)]
        return [c.result for c in calls]
    with counting(lm.tokenizer) as counts:
        got = three(remote)
    for g, w in zip(got, three(lm)):
        assert torch.allclose(g, w, atol=1e-5)
    assert counts == {"tokenize": 1, "job": 2}, counts   # one call of the tokenizer for the job's prompts

    with model_trace_failing(remote) as tr:    # a prompt that cannot run is still named by its invoke
        tr.invoke(PROMPT, read)
        tr.invoke("", read)


def test_a_tenants_prompts_are_kept_for_it_alone(lm, live):
    """A sweep sends its prompts again: the server keeps their ids for the tenant that sent them (no tokenizer
    call the second time), never for another tenant, who would learn from the timing that they were sent."""
    mine, theirs = ai.remote(live.url, api_key=KEY), ai.remote(live.url, api_key=OTHER_KEY)
    prompts = ("A sweep's first prompt, sent again and again", "and its second, a few tokens longer than that")

    async def read(m):
        return (await m.lm_head.output)[:, -1].clone()

    def both(model):
        with model.trace() as tr:
            calls = [tr.invoke(x, read) for x in prompts]
        return [c.result for c in calls]
    want = both(lm)
    for name, who, calls in (("mine", mine, 1), ("mine", mine, 0), ("mine", mine, 0), ("theirs", theirs, 1),
                             ("theirs", theirs, 0)):
        with counting(lm.tokenizer) as counts:
            got = both(who)
        assert counts == {"tokenize": calls, "job": 2}, (name, counts)
        for g, w in zip(got, want):
            assert torch.allclose(g, w, atol=1e-5)
    with counting(lm.tokenizer) as counts:     # one prompt kept, one new: only the new one is tokenized
        with mine.trace() as tr:
            kept = tr.invoke(prompts[0], read)
            new = tr.invoke("a prompt this tenant never sent", read)
    assert counts == {"tokenize": 1, "job": 2}, counts
    assert torch.allclose(kept.result, want[0], atol=1e-5)
    assert torch.allclose(new.result, lm.trace("a prompt this tenant never sent", read), atol=1e-5)


@contextlib.contextmanager
def model_trace_failing(model):
    with pytest.raises(Exception, match="invoke 1: input: empty prompt"):
        with model.trace() as tr:
            yield tr


@pytest.mark.vllm
def test_one_openai_completion_on_vllm_tokenizes_once_and_makes_params_once(tiny_dir):
    from vllm_helpers import cli_engine
    from asyncinterp.models.vllm import requests as vllm_requests
    vm = cli_engine(tiny_dir, "--disable-log-stats", "--served-model-name", "tiny-vllm")
    srv = Live(Server(vm, api_keys=[KEY], name="tiny-vllm"))
    made = []
    real = vllm_requests.request_params

    def counted(*a, **kw):
        made.append(a)
        return real(*a, **kw)
    try:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
            c.completions.create(model="tiny-vllm", prompt="warm up", max_tokens=2, temperature=0)
            from asyncinterp.models.vllm import engine as vllm_engine, jobs as vllm_jobs
            patches = [(vllm_engine, "request_params"), (vllm_jobs, "request_params")]
            for mod, name in patches:
                setattr(mod, name, counted)
            try:
                with counting(vm.tokenizer) as counts:
                    resp = c.completions.create(model="tiny-vllm", prompt=PROMPT, max_tokens=3, temperature=0)
            finally:
                for mod, name in patches:
                    setattr(mod, name, real)
        assert resp.choices[0].text
        assert counts == {"tokenize": 1, "job": 1}, counts
        assert len(made) == 1, made          # its SamplingParams, made once
    finally:
        srv.close()
        vm.close()


# ----------------------------------------------------------------------------- process isolation
# Registered interventions run in the worker process: one installs the same counters there, another reads them.
_WORKER_COUNTS = {}


async def install_counters(m):
    import contextlib as _c
    if "stack" not in _WORKER_COUNTS:
        stack = _c.ExitStack()
        _WORKER_COUNTS["counts"] = stack.enter_context(counting(ai.models.tiny("gpt2").tokenizer))
        _WORKER_COUNTS["stack"] = stack
    _WORKER_COUNTS["counts"].update(tokenize=0, job=0)
    return 0


async def read_counters(m):
    return dict(_WORKER_COUNTS["counts"])


def test_a_remote_trace_under_process_isolation_is_read_and_tokenized_once_in_its_worker(lm):
    from asyncinterp.serve.workers.supervisor import ProcessIsolation
    server = Server(lm, api_keys=[KEY, OTHER_KEY], allow_code=True, isolation=ProcessIsolation(code_worker=False))
    server.intervention("install_counters")(install_counters)
    server.intervention("read_counters")(read_counters)
    srv = Live(server)
    try:
        remote = ai.remote(srv.url, api_key=KEY)

        async def read(m):
            return (await m.lm_head.output)[:, -1].clone()
        remote.trace("warm up", read)
        with ai.serve.Client(srv.url, api_key=KEY, timeout=60) as client:
            client.trace("warm up", "install_counters")     # counters on in the worker (its previous request)
            with counting(lm.tokenizer) as here:
                got = remote.trace(PROMPT, read)
            there = client.trace("x", "read_counters")
        assert torch.allclose(got, lm.trace(PROMPT, read), atol=1e-5)
        # this process: the client's Job; the server passes the job on unread (its outline only); the worker
        # reads, checks and tokenizes it once, and runs it as its one Job
        assert here == {"tokenize": 0, "job": 1}, here
        # (the reading request's own batch is a Job too, made before its intervention reads the counts)
        assert there == {"tokenize": 1, "job": 1 + 1}, there
        # the worker keeps the prompt's ids for the tenant that sent it (the server tells it the job's owner)
        theirs = ai.remote(srv.url, api_key=OTHER_KEY)
        for who, calls in ((remote, 0), (theirs, 1), (theirs, 0)):
            with ai.serve.Client(srv.url, api_key=KEY, timeout=60) as client:
                client.trace("warm up", "install_counters")
                assert torch.allclose(who.trace(PROMPT, read), lm.trace(PROMPT, read), atol=1e-5)
                there = client.trace("x", "read_counters")
            assert there == {"tokenize": calls, "job": 1 + 1}, (who is remote, there)
    finally:
        srv.close()
