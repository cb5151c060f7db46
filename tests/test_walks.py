"""docs/design.md's walks are measured, not drawn by hand: rerun the local and remote walks and compare.

``scripts/walks.py local remote`` runs ``model.trace(x, fn)`` on tiny GPT-2 and ``ai.remote(url).trace(x, fn)``
against ``asyncinterp serve tiny-gpt2 --allow-code`` (process isolation), catches the call stacks of every
process at the first hook firing and prints the hops as markdown. Every line it prints must be on the
page, between ``<!-- walks -->`` and ``<!-- /walks -->``: when the code changes the path a request takes,
rerun the script (all four walks) and paste its output there.
"""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def design_block() -> list:
    text = (ROOT / "docs" / "design.md").read_text()
    start, end = text.index("<!-- walks -->"), text.index("<!-- /walks -->")
    return text[start:end].splitlines()


def test_the_local_and_remote_walks_are_what_design_md_says():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "walks.py"), "local", "remote"], capture_output=True,
                         text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert any(line.startswith("| local trace |") for line in lines)
    assert any(line.startswith("| remote trace |") for line in lines)
    assert sum(line.startswith("- process") for line in lines) >= 3   # the caller, the server, the worker
    page = design_block()
    stale = [line for line in lines if line not in page]
    assert not stale, ("docs/design.md's walks are stale; rerun `PYTHONPATH=src python scripts/walks.py` and paste "
                       "its output between <!-- walks --> and <!-- /walks -->. Lines not on the page:\n" + "\n".join(stale))
