"""examples/diffusion_steering.py runs offline and writes two different PNGs."""

import pathlib
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("diffusers")
from PIL import Image  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("pipeline", ["unet"])   # the transformer pipeline: tests/test_diffusion.py
def test_diffusion_steering_example(tmp_path, pipeline):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "diffusion_steering.py"), str(tmp_path),
                           "--pipeline", pipeline, "--steps", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, after = tmp_path / "before.png", tmp_path / "after.png"
    assert before.exists() and after.exists()
    a = np.asarray(Image.open(before), dtype=np.int16)
    b = np.asarray(Image.open(after), dtype=np.int16)
    assert a.shape == b.shape == (8, 8, 3)
    assert np.abs(a - b).max() > 0
