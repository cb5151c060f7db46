"""The snippets in docs/remote.md run as written (their functions' source is registered, as a notebook's is)."""

import linecache

from docsnippets import python_blocks


def test_remote_page_runs(capsys):
    blocks = python_blocks("remote.md")
    assert len(blocks) >= 4
    ns = {"__name__": "__docs__"}
    for i, block in enumerate(blocks):
        filename = f"remote.md[block {i}]"
        linecache.cache[filename] = (len(block), None, block.splitlines(True), filename)   # what notebooks do
        exec(compile(block, filename, "exec"), ns)  # noqa: S102 - our own documentation
    out = capsys.readouterr().out
    assert "['steered', 'halve']" in out
    assert "reads 'handle'" in ns["message"] and "TextIOWrapper" in ns["message"]
    assert "format 99" in out and "dry run equals the local run" in out
