"""The ```python vllm blocks of docs/lora.md and docs/moe.md run as written, after the page's other blocks.

(Those blocks start a vLLM engine each, closed before the next: this module is marked ``vllm``.)
"""

import re

import pytest
import torch

from docsnippets import DOCS, run_page
from vllm_helpers import require_vllm

pytestmark = pytest.mark.vllm


def vllm_blocks(page: str) -> list[str]:
    return re.findall(r"```python vllm\n(.*?)```", (DOCS / page).read_text(), flags=re.S)


def run_with_vllm(page: str) -> dict:
    require_vllm()
    try:
        ns = run_page(page)
        for i, block in enumerate(vllm_blocks(page)):
            exec(compile(block, f"{page}[vllm block {i}]", "exec"), ns)  # noqa: S102 - our own documentation
    finally:
        torch.set_grad_enabled(True)
    return ns


def test_lora_page_vllm_block(capsys):
    pytest.importorskip("peft")
    assert len(vllm_blocks("lora.md")) == 1
    run_with_vllm("lora.md")
    out = capsys.readouterr().out
    assert "['red', 'blue']\n" in out and "True\n4 4\n" in out     # (vLLM may log in between)


def test_moe_page_vllm_block(capsys):
    assert len(vllm_blocks("moe.md")) == 1
    run_with_vllm("moe.md")
    out = capsys.readouterr().out
    assert "model.layers.0.block_sparse_moe\n" in out and "True True True True\n" in out
