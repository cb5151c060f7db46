"""The snippets in docs/semantics.md run as written."""

from docsnippets import python_blocks, run_page


def test_semantics_page_runs(capsys):
    assert len(python_blocks("semantics.md")) >= 10
    ns = run_page("semantics.md")
    out = capsys.readouterr().out
    assert "already ran" in out and "never ran" in out and "shape" in out
    assert ns["patched"].result.shape == (1, 2)
