"""Runnable docs pages through ai.remote against one live server: every job's remote results equal the local ones.

Each page runs as written (its own asserts and prints hold); every job it
runs is also sent to a live server serving the same model (tests/remote_mirror.py).
Whatever fails remotely must be on docs/remote.md's list of what cannot run
remotely (matched by its error), and the rest must give equal results (1e-5).
"""

import pytest

from remote_mirror import Mirror
from serve_helpers import one_thread  # noqa: F401 - fixture found by name

# what docs/remote.md lists as not running remotely, by the error a user sees (see its table)
CANNOT = {
    "persistent edits": "persistent edits (model.edit) do not run remotely",
}


@pytest.fixture(scope="module")
def mirror(one_thread):
    m = Mirror()
    yield m
    m.close()


def _run(mirror, page):
    with mirror:
        mirror.run_page(page)
    return [r for r in mirror.records if r["page"] == page]


def _summary(records):
    return "\n".join(f"{r['outcome']}: {r.get('error', '')[:300]}" for r in records)


@pytest.mark.parametrize("page", ["semantics.md", "cache.md"])
def test_core_pages_run_remotely_with_local_results(mirror, page):
    records = _run(mirror, page)
    print(_summary(records))
    assert records
    assert [r for r in records if r["outcome"] == "remote_failed"] == [], _summary(records)


@pytest.mark.smollm2
@pytest.mark.parametrize("page", ["generation.md", "language-models.md"])
def test_language_model_pages_run_remotely_with_local_results(mirror, page):
    records = _run(mirror, page)
    print(_summary(records))
    assert records
    assert [r for r in records if r["outcome"] == "remote_failed"] == [], _summary(records)
