"""examples/attribution_patching.py runs on SmolLM2 and its estimates agree with real patching."""

import importlib.util
import pathlib

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "attribution_patching.py"


@pytest.mark.smollm2
def test_attribution_patching_example(capsys):
    pytest.importorskip("asyncinterp.models.hf.language")
    from asyncinterp.models import bundled
    try:
        bundled.smollm2_gguf_path()
    except bundled.BundledModelError as exc:  # pragma: no cover - the package is part of the test setup
        pytest.skip(str(exc))
    spec = importlib.util.spec_from_file_location("attribution_patching", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    attribution, rows = mod.main()
    out = capsys.readouterr().out
    assert "rank" in out and "actual patch" in out and "attribution by layer" in out
    assert attribution.shape[0] == 30
    # the top-ranked estimates are real effects: patching them moves the metric most of the way back
    for layer, pos, tok, estimate, actual in rows:
        assert estimate > 0 and actual > 0.5 * estimate
