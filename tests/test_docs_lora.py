"""The snippets in docs/lora.md run as written."""

import pytest
import torch

pytest.importorskip("peft")

from docsnippets import python_blocks, run_page  # noqa: E402


def test_lora_page_runs(capsys):
    assert len(python_blocks("lora.md")) >= 3
    try:
        ns = run_page("lora.md")
    finally:
        torch.set_grad_enabled(True)
    out = capsys.readouterr().out
    assert "['red', 'blue'] red" in out and out.count("True") >= 2
    assert ns["model"].active_adapter == "red"
