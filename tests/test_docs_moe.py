"""The transformers snippets of docs/moe.md run as written (its ```python vllm block: test_docs_vllm_families.py)."""

import torch

from docsnippets import python_blocks, run_page


def test_moe_page_runs(capsys):
    assert len(python_blocks("moe.md")) >= 4
    try:
        run_page("moe.md")
    finally:
        torch.set_grad_enabled(True)
    out = capsys.readouterr().out
    assert "torch.Size([1, 4, 4]) torch.Size([1, 4, 4, 64]) torch.Size([1, 4, 64])" in out
    assert out.count("True") == 5 and "4 4" in out   # issue 33: a replaced gate tuple re-routes too
