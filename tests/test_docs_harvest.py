"""The snippets in docs/harvest.md run as written: a harvest of SmolLM2, a tiny SAE trained on it with SAELens,
and its features read back through the SAE splice."""

import os

import pytest

from docsnippets import python_blocks, run_page

pytestmark = [pytest.mark.smollm2, pytest.mark.slow]


def test_harvest_page_runs(tmp_path, capsys, monkeypatch):
    pytest.importorskip("sae_lens")
    monkeypatch.chdir(tmp_path)
    assert len(python_blocks("harvest.md")) >= 5
    ns = run_page("harvest.md")
    out = capsys.readouterr().out
    assert "Array2D(shape=(64, 576), dtype='float32')" in out
    assert "blocks.6.hook_resid_post" in out and "torch.Size([1, 64, 512])" in out
    assert ns["result"].windows > 20 and os.path.exists(tmp_path / "smol-harvest" / "state.json")
