"""The snippets in docs/diffusion.md run as written."""

import pytest
import torch

pytest.importorskip("diffusers")

from docsnippets import python_blocks, run_page  # noqa: E402


def test_diffusion_page_runs(capsys):
    assert len(python_blocks("diffusion.md")) >= 6
    try:
        ns = run_page("diffusion.md")
    finally:
        torch.set_grad_enabled(True)   # the page turns gradients off
    out = capsys.readouterr().out
    assert "unet" in out and "(8, 8)" in out and "2 4" in out and "4 8" in out and "(1, 1)" in out
    assert "True" in out
    assert len(ns["trajectory"].__code__.co_varnames) > 0
    assert len(ns["steered"].images) == 1
