"""The snippets in docs/vision-language.md run as written, and print what the page says."""

import pytest
import torch

pytest.importorskip("PIL")

from docsnippets import python_blocks, run_page  # noqa: E402


def test_vision_language_page_runs(capsys):
    assert len(python_blocks("vision-language.md")) >= 5
    try:
        run_page("vision-language.md")
    finally:
        torch.set_grad_enabled(True)
    out = capsys.readouterr().out
    assert "VisionLanguageModel llava" in out
    assert "model.vision_tower model.multi_modal_projector model.language_model" in out
    assert "((1, 17, 32), (1, 16, 64), (1, 20, 64))" in out
    assert "((2, 17, 32), (2, 16, 64), (1, 39, 64))" in out
    assert "True True" in out
    assert "[[slice(2, 18, None), slice(20, 36, None)]]" in out
    assert "(32, 8, 8) (60, 15, 15)" in out
    assert "[0, 1, 2] 3" in out
