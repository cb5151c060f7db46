"""The snippets in docs/remote.md run as written (their functions' source is registered, as a notebook's is),
the remote ones against a live server on the same tiny model."""

import linecache

import pytest

from asyncinterp.models import tiny
from asyncinterp.serve import Server
from docsnippets import python_blocks
from remote_helpers import Live
from serve_helpers import one_thread  # noqa: F401 - fixture found by name

KEY = "docs-key"


@pytest.fixture(scope="module")
def live(one_thread):
    server = Live(Server(tiny("gpt2"), api_keys=[KEY], allow_code=True))
    yield server
    server.close()


def test_remote_page_runs(capsys, live):
    blocks = python_blocks("remote.md")
    assert len(blocks) >= 6
    ns = {"__name__": "__docs__", "url": live.url, "key": KEY}
    for i, block in enumerate(blocks):
        filename = f"remote.md[block {i}]"
        linecache.cache[filename] = (len(block), None, block.splitlines(True), filename)   # what notebooks do
        exec(compile(block, filename, "exec"), ns)  # noqa: S102 - our own documentation
    out = capsys.readouterr().out
    assert "['steered', 'halve']" in out
    assert "reads 'handle'" in ns["message"] and "TextIOWrapper" in ns["message"]
    assert "format 99" in out and "dry run equals the local run" in out
    assert "remote equals local" in out
    ns["lm"].close()
