"""The demo: CLI parsing, every section on a tiny model, and the full run on SmolLM2."""

import os
import subprocess
import sys

import pytest
import torch

import asyncinterp as ai
from asyncinterp import cli, demo


def test_cli_help_lists_demo(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "demo" in capsys.readouterr().out
    assert cli.main([]) == 2


def test_demo_on_tiny_model(tmp_path, capsys):
    assert cli.main(["demo", "--model", "tiny", "--out", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    for section in ("Next token", "Causal tracing", "Logit lens", "Steering"):
        assert section in out
    png = tmp_path / "causal_trace.png"
    assert png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = (tmp_path / "causal_trace.csv").read_text().splitlines()
    assert lines[0].startswith("layer,subject,pos0")


def test_patch_runs_equal_one_by_one(tmp_path):
    """Batching the patched runs as invokes gives the same numbers as running them one at a time."""
    lm = ai.models.tiny("llama")
    tid = demo.target_id(lm, demo.TARGET)
    with torch.no_grad():
        states, _ = demo.record_layers(lm, demo.CLEAN)
        batched = demo.patch_runs(lm, demo.CORRUPT, states, tid, [[2], [5]])
        for i, layer in enumerate(demo._layers(lm)):
            for j, pos in enumerate([[2], [5]]):
                one = lm.trace(demo.CORRUPT, demo._patch(layer, pos, states[i], tid))
                assert abs(one - float(batched[i, j])) < 1e-5


def test_unequal_prompt_lengths_are_a_clear_error():
    lm = ai.models.tiny("llama")
    with pytest.raises(ValueError, match="same number of tokens"):
        demo.subject_positions(lm, "The Eiffel Tower is in", "Rome is in")


@pytest.mark.smollm2
def test_demo_command_on_smollm2(tmp_path):
    """`asyncinterp demo` as a user runs it: a subprocess, default model."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "asyncinterp.cli", "demo", "--out", str(tmp_path), "--no-progress"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "'The capital of France is' -> ' Paris'" in out
    assert (tmp_path / "causal_trace.png").stat().st_size > 20_000
    rows = [list(map(float, line.split(","))) for line in (tmp_path / "causal_trace.csv").read_text().splitlines()[1:]]
    assert len(rows) == 30
    assert rows[0][1] > 0.5 and rows[-1][1] < 0.01       # subject patch: early layers restore, last do not
    assert "steered:" in out and "Done in" in out
