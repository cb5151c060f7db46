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

from docsnippets import DOCS
from remote_mirror import Mirror
from serve_helpers import one_thread  # noqa: F401 - fixture found by name

# docs/remote.md's rows of what cannot run remotely -> the error a user gets (a regex)
CANNOT = {
    "ai.gradients(...)": r"asyncinterp\.gradients is not available to submitted code",
    "a cache filter function": r"a cache filter function cannot travel",
    "a cache used inside another intervention": r"a asyncinterp\.tools\.cache\.Cache, which cannot travel",
    "inf or nan written into the model": r"holds inf or nan",
}


@pytest.fixture(scope="module")
def mirror(one_thread):
    m = Mirror()
    yield m
    m.close()


def _check(mirror, page, at_least):
    with mirror:
        mirror.run_page(page)
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
