"""One submission type: every entry point's job reaches the front as a Submission with its serving envelope.

The front is an engine (``make_invoke``, ``start(job)``): a job (or the parts a server read) goes in as it
is, answers as ``model.trace`` answers, and carries its owner, budget, deadline, receipt and listener.
"""

import asyncio
import hashlib

import httpx
import pytest
import torch

import asyncinterp as ai

from asyncinterp.job import InvokeSpec, Job
from asyncinterp.serve import Batcher, Server
from asyncinterp.serve.scheduling import batcher as batcher_module
from asyncinterp.serve.scheduling.requests import Meter
from asyncinterp.serve.scheduling.submission import Envelope, Submission
from remote_helpers import Live
from serve_helpers import model, one_thread  # noqa: F401 - fixtures are found by name

KEY = "submission-test-key"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def last(m):
    return (await m.lm_head.output)[:, -1].clone()


async def fails(m):
    await m.transformer.h[0].output
    raise ValueError("invoke 0 fails on purpose")


async def slow_reader(m):
    outs = []
    for block in m.transformer.h:
        outs.append((await block.output)[:, -1].clone())
    return outs


def test_a_job_goes_to_the_front_as_it_is_and_answers_as_locally(model):
    job = Job((InvokeSpec("The cat sat on the", (last,)), InvokeSpec("Paris is the capital of", (last,))))

    async def main():
        async with Batcher(model, max_batch=4) as front:
            sub = front.start(job, Envelope(owner="me", budget=Meter(), deadline=30.0, receipt={"r": 1}))
            assert isinstance(sub, Submission) and sub.size == 2 and sub.envelope.owner == "me"
            assert sub.envelope.receipt == {"r": 1} and sub.meter is sub.envelope.budget
            return await front.answer(sub)
    outcomes = run(main())
    with model.trace() as tr:
        a = tr.invoke("The cat sat on the", last)
        b = tr.invoke("Paris is the capital of", last)
    assert [ok for ok, _ in outcomes] == [True, True]
    assert torch.allclose(outcomes[0][1], a.result, atol=1e-5) and torch.allclose(outcomes[1][1], b.result, atol=1e-5)


def test_a_single_submission_answers_its_one_value(model):
    job = Job((InvokeSpec("The cat sat on the", (last,)),))

    async def main():
        async with Batcher(model) as front:
            return await front.answer(front.start(job, single=True))
    assert torch.equal(run(main()), model.trace("The cat sat on the", last))


def test_a_failing_invoke_fails_alone_in_its_outcome_and_the_others_keep_theirs(model):
    def job(on_error):
        return Job((InvokeSpec("The cat sat on the", (fails,)), InvokeSpec("Paris is the capital of", (slow_reader,))),
                   on_error=on_error)

    async def main(on_error):
        async with Batcher(model, max_batch=4) as front:
            return await front.answer(front.start(job(on_error)))
    stopped = run(main("stop"))    # the client raises the first failure of a job with on_error="stop"
    assert stopped[0][0] is False and isinstance(stopped[0][1], ValueError)
    kept = run(main("continue"))
    assert kept[0][0] is False and kept[1][0] is True and len(kept[1][1]) == len(model.transformer.h)


def test_what_a_served_run_cannot_honour_is_refused_not_dropped(model):
    front = Batcher(model)
    try:
        with pytest.raises(ValueError, match="persistent edits"):
            front.start(Job((InvokeSpec(None, (last,), background=True), InvokeSpec("hello", (last,)))))
        with pytest.raises(ValueError, match="context"):
            front.start(Job((InvokeSpec("hello", (last,)),), context={"secret": 1}))
        assert front.queue_size() == 0
    finally:
        front.close()


def test_the_fronts_make_invoke_refuses_a_bad_intervention_on_the_callers_line(model):
    front = Batcher(model)
    try:
        with pytest.raises(TypeError):
            front.make_invoke(0, "hello", (42,), {}, False)
        inv = front.make_invoke(0, "hello", (last,), {}, False)
        assert inv.spec.input == "hello" and inv.spec.fns == (last,)
    finally:
        front.close()


def test_a_cancelled_submission_never_runs_and_calls_its_listener(model):
    ran, heard = [], []

    async def never(m):
        ran.append(1)
        return await m.lm_head.output

    async def main():
        async with Batcher(model, max_batch=1) as front:
            blocker = front.start(Job((InvokeSpec("The cat sat on the", (slow_reader,)),)), single=True)
            queued = front.start(Job((InvokeSpec("Paris", (never,)),)), Envelope(listener=lambda: heard.append(1)),
                                 single=True)
            assert queued.cancel() is True and queued.cancel() is False
            front.unqueue(queued)
            await front.answer(blocker)
            return queued.state
    assert run(main()) == "cancelled" and ran == [] and heard == [1]


@pytest.fixture(scope="module")
def live(model):
    server = Server(model, api_keys=[KEY], allow_code=True, isolation="thread", max_batch=4, timeout=30)
    server.intervention("last")(last)
    live = Live(server)
    yield live
    live.close()


def test_every_entry_reaches_the_front_as_one_submission_with_its_envelope(live, monkeypatch):
    seen = []
    submit = batcher_module.Batcher._submit

    def record(self, sub):
        seen.append(sub)
        return submit(self, sub)
    monkeypatch.setattr(batcher_module.Batcher, "_submit", record)
    owner = hashlib.sha256(KEY.encode()).hexdigest()
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=live.url, headers=headers, timeout=60) as http:
        r = http.post("/v1/completions", json={"model": live.server.name, "prompt": ["The cat", "A dog"],
                                               "max_tokens": 3, "temperature": 1.0, "seed": 7, "n": 2})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 4
    lm = ai.remote(live.url, api_key=KEY)
    with lm.trace() as tr:                       # a remote job of two invokes: one submission of two invokes
        a = tr.invoke("The cat sat on the", last)
        b = tr.invoke("Paris is the capital of", last)
    assert torch.allclose(a.result, live.server.model.trace("The cat sat on the", last), atol=1e-5)
    job = seen.pop()
    assert type(job) is Submission and job.size == 2 and job.envelope.owner == owner
    # translated once: the server's tokenization is what the front runs
    assert list(job.invokes[1].input) == live.server.model.tokenizer("Paris is the capital of")["input_ids"]
    # each prompt and each n is one submission; every one carries its owner, deadline and receipt
    assert len(seen) == 4 and all(type(s) is Submission and s.size == 1 for s in seen)
    assert all(s.envelope.owner == owner and s.envelope.deadline == 30 for s in seen)
    receipts = [s.envelope.receipt for s in seen]
    assert all(r is not None and r["digest"].startswith("sha256:") for r in receipts)
    assert len({r["digest"] for r in receipts[:4]}) == 4   # two prompts, two samples each (their own seeds)
