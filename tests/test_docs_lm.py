"""The snippets in docs/language-models.md and docs/generation.md run as written (on SmolLM2)."""

import pytest

from docsnippets import python_blocks, run_page

pytestmark = pytest.mark.smollm2


@pytest.fixture(autouse=True)
def restore_grad_mode():
    """The scripts/pages switch autograd off globally (inference only); later tests need it back."""
    import torch
    enabled = torch.is_grad_enabled()
    yield
    torch.set_grad_enabled(enabled)


def test_language_models_page_runs(capsys):
    assert len(python_blocks("language-models.md")) >= 6
    ns = run_page("language-models.md")
    out = capsys.readouterr().out
    assert "(1, 1, 49152)" in out and "(1, 1, 576)" in out
    assert "no tokens" in out and "exceeds the model's context" in out
    assert ns["p"][0] > 0.5


def test_generation_page_runs(capsys):
    assert len(python_blocks("generation.md")) >= 6
    ns = run_page("generation.md")
    out = capsys.readouterr().out
    assert ns["gen"].stopped
    assert "awaited model.layers.2.output" in out
    assert ns["a"].result == ns["b"].result == 3
    assert ns["sliced"].result == [1, 2] and len(ns["sliced"].tokens) == 5 and not ns["sliced"].stopped
    assert ns["short"].stopped and len(ns["short"].tokens) == 1
