"""Runnable docs pages through ai.remote against one live server: every job's remote results equal the local ones.

Each page runs as written (its own asserts and prints hold); every job it
runs is also sent, unchanged, to a live server serving the same model
(tests/remote_mirror.py). A job that fails remotely but not locally must be
on docs/remote.md's list of what cannot run remotely (matched by its clear
error); a job that fails on both sides fails with the same exception type;
every other job gives equal results (1e-5).
"""

import re

import pytest
import torch

import asyncinterp as ai

from docsnippets import DOCS
from asyncinterp.client.wire import RemoteError
from remote_mirror import Mirror, same
from serve_helpers import one_thread  # noqa: F401 - fixture found by name

# docs/remote.md's rows of what cannot run remotely -> the error a user gets (a regex)
CANNOT = {
    "ai.gradients(...)": r"asyncinterp\.gradients is not available to submitted code",
    "a `with model.session() as s:` block": r"a asyncinterp\.tools\.session\.Session, which cannot travel"
                                            r"|a remote session is a function",
    "a value passed from one run to a later one": r"UnsetFutureError(.|\n)*a value that an earlier remote run set "
                                                  r"does not reach a later run",
    "a cache filter function": r"a cache filter function cannot travel",
    "a cache used inside another intervention": r"a asyncinterp\.tools\.cache\.Cache, which cannot travel",
    "inf or nan written into the model": r"holds inf or nan",
}


@pytest.fixture(scope="module")
def mirror(one_thread):
    m = Mirror()
    yield m
    m.close()


def _check(mirror, page, at_least, namespace=None):
    with mirror:
        mirror.run_page(page, namespace)
    records = [r for r in mirror.records if r["page"] == page]
    summary = "\n".join(f"{r['outcome']}: {r.get('error', '')[:300]}" for r in records)
    print(summary)
    assert sum(r["outcome"] == "equal" for r in records) >= at_least, summary
    assert not [r for r in records if r["outcome"] == "local_only_failed"], summary
    for r in records:
        if r["outcome"] == "remote_failed":
            assert any(re.search(p, r["error"]) for p in CANNOT.values()), f"not listed in docs/remote.md: {r}"
        if r["outcome"] == "both_failed":
            assert r["same_type"], f"a different error remotely: {r}"
    return records


def test_semantics_page_runs_remotely_with_local_results(mirror):
    _check(mirror, "semantics.md", at_least=12)


def test_cache_page_runs_remotely_with_local_results(mirror):
    _check(mirror, "cache.md", at_least=5)


@pytest.mark.smollm2
def test_generation_page_runs_remotely_with_local_results(mirror):
    _check(mirror, "generation.md", at_least=8)


@pytest.mark.smollm2
def test_language_models_page_runs_remotely_with_local_results(mirror):
    _check(mirror, "language-models.md", at_least=8)


def test_what_cannot_run_remotely_is_listed_in_docs():
    text = (DOCS / "remote.md").read_text()
    section = text.split("## What cannot run remotely", 1)[1]
    for row in CANNOT:
        assert row in section, row


def test_sessions_page_runs_remotely_with_local_results(mirror):
    ns = {}
    records = _check(mirror, "sessions.md", at_least=3, namespace=ns)
    # what needs values on this machine between runs fails remotely (listed, clear errors): the plain-Python
    # patch run that awaits a future set by an earlier run, and the two runs of the `with model.session()` block
    assert [r["outcome"] for r in records].count("remote_failed") == 3, records
    # the page's session function runs on the server as one request, with the local result
    remote = mirror.remote_for(ns["model"])
    same(ns["patched"], remote.session(ns["patched_run"]), "sessions.md: lm.session(patched_run)")


def test_gradients_page_runs_remotely_with_local_results(mirror):
    ns = {}
    records = _check(mirror, "gradients.md", at_least=4, namespace=ns)
    assert [r["outcome"] for r in records].count("remote_failed") == 2, records     # the two ai.gradients runs
    # a remote backward accumulates nothing into the served model's parameters (docs/remote.md)
    net, remote = ns["net"], mirror.remote_for(ns["model"])
    net.zero_grad()
    remote.trace(ns["x"], ns["zero_grad_through_layer2"], ns["train_step"])
    assert all(p.grad is None for p in net.parameters())


def test_what_the_sessions_and_gradients_pages_cannot_run_remotely_fails_clearly(mirror):
    torch.manual_seed(0)
    model = ai.wrap(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4)))
    remote, x = mirror.remote_for(model), torch.randn(2, 4)

    with pytest.raises(TypeError, match="a remote session is a function"):
        remote.session()

    with ai.Session() as s:
        async def record_in_session(m):
            s["clean"].set_result((await m[0].output).clone())

        with pytest.raises(TypeError, match="record_in_session reads 's'.*Session, which cannot travel"):
            s.trace(x, record_in_session, model=remote)

    clean = ai.Future()

    async def record(m):
        clean.set_result((await m[0].output).clone())

    async def patch(m):
        h = await m[0].output
        h[:] = await clean
        return (await m[2].output).clone()

    remote.trace(x, record)
    assert not clean.done()                     # the server's copy was set, not this one
    with pytest.raises(ai.UnsetFutureError, match="does not reach a later run(.|\n)*lm.session"):
        remote.trace(x, patch)

    async def with_gradients(m):
        grads = ai.gradients(m[0].output)
        out = await m.output
        return await grads.backward(out.sum())

    with pytest.raises(RemoteError, match="asyncinterp.gradients is not available to submitted code"):
        remote.trace(x, with_gradients)
