"""The example scripts run: on a tiny model always, on SmolLM2 when its tests are selected."""

import pathlib
import runpy
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
SCRIPTS = ["lm_quickstart.py", "causal_tracing.py", "steering_generation.py", "logit_lens.py", "sae_splice.py"]


@pytest.fixture(autouse=True)
def restore_grad_mode():
    """The scripts/pages switch autograd off globally (inference only); later tests need it back."""
    import torch
    enabled = torch.is_grad_enabled()
    yield
    torch.set_grad_enabled(enabled)


def run_example(name, model, monkeypatch):
    monkeypatch.setattr(sys, "argv", [name, "--model", model])
    monkeypatch.syspath_prepend(str(EXAMPLES))
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")


@pytest.mark.parametrize("name", SCRIPTS)
def test_example_runs_on_tiny_model(name, monkeypatch, capsys):
    run_example(name, "tiny", monkeypatch)
    assert capsys.readouterr().out.strip()


@pytest.mark.smollm2
def test_examples_on_smollm2(monkeypatch, capsys):
    outputs = {}
    for name in SCRIPTS:
        run_example(name, "smollm2", monkeypatch)
        outputs[name] = capsys.readouterr().out
    assert "next token:         ' Paris'" in outputs["lm_quickstart.py"]
    assert "' Rome'" in outputs["lm_quickstart.py"]
    assert "seashells" in outputs["steering_generation.py"]
    assert "' Paris'" in outputs["logit_lens.py"].splitlines()[-1]
    iffel = next(line for line in outputs["causal_tracing.py"].splitlines() if "'iffel'" in line)
    assert float(iffel.split()[3]) > 0.5
