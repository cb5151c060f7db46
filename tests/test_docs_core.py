"""The snippets in docs/semantics.md run as written."""

from docsnippets import python_blocks, run_page


def test_semantics_page_runs(capsys):
    assert len(python_blocks("semantics.md")) >= 10
    ns = run_page("semantics.md")
    out = capsys.readouterr().out
    assert "already ran" in out and "never ran" in out and "shape" in out
    assert ns["patched"].result.shape == (1, 2)


def test_design_page_worked_example_runs():
    # the new kind of point in docs/design.md, built on public interfaces only
    ns = run_page("design.md")
    assert ns["norms"].shape == (3,)
    model, x = ns["model"], ns["x"]
    with model.trace() as tr:   # per invoke: each sees its own rows
        a = tr.invoke(x[:1], ns["read_norms"])
        b = tr.invoke(x[1:], ns["read_norms"])
    assert a.result.shape == (1,) and b.result.shape == (2,)
    import torch
    assert torch.allclose(torch.cat([a.result, b.result]), ns["norms"])
