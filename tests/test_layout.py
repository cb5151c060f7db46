"""The package layout stays legible: no import cycles, few modules at the top."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "asyncinterp"

# layers whose import cycles this test fails on at once; a cycle elsewhere is reported as an expected failure
# until it is broken (hooks.grad <-> hooks.points is handled with the hooks/ rework)
STRICT = ("asyncinterp.serve", "asyncinterp.aio")


def test_no_import_cycles():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "import_cycles.py")], capture_output=True,
                         text=True, timeout=120)
    text = out.stdout + out.stderr
    if out.returncode == 0:
        assert "no import cycles" in text
        return
    cycles = [line for line in text.splitlines() if line.startswith("cycle among")]
    assert cycles, text
    strict = [c for c in cycles if any(p in c for p in STRICT)]
    assert not strict, text
    pytest.xfail("import cycles outside serve/aio remain:\n" + text)


def test_at_most_ten_top_level_modules():
    modules = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(modules) <= 10, modules
