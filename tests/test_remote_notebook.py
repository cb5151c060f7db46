"""examples/remote.ipynb in a real Jupyter kernel: helpers defined in notebook cells run on a live server.

The test starts one server for the module (tiny GPT-2, seed 0, ``--allow-code``,
an API key) with uvicorn on a loopback port in a thread of this process; the
kernel is another process (nbclient + ipykernel) and finds the server through
``ASYNCINTERP_URL`` / ``ASYNCINTERP_API_KEY``. The notebook compares every
remote result with the same function run on a local tiny GPT-2 in the kernel
and prints "remote equals local" for each; the test checks those lines, and
that the server really ran the jobs and the session.
"""

import json
import pathlib
import sys

import pytest

from asyncinterp.models import tiny
from asyncinterp.serve import Server
from remote_helpers import Live
from serve_helpers import one_thread  # noqa: F401 - fixture found by name

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = pathlib.Path(__file__).resolve().parent.parent / "examples" / "remote.ipynb"
KEY = "notebook-key"


@pytest.fixture(scope="module")
def live(one_thread):
    server = Server(tiny("gpt2"), api_keys=[KEY], allow_code=True, max_batch=8, max_wait_ms=0,
                    code_budget=30.0, timeout=120.0)
    live = Live(server)
    yield live
    live.close()


@pytest.fixture
def kernel(tmp_path, monkeypatch, live):
    """A kernelspec that starts ipykernel with this interpreter, and the server's address in its environment."""
    spec = tmp_path / "kernels" / "asyncinterp-remote-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "asyncinterp remote test kernel", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    monkeypatch.setenv("ASYNCINTERP_URL", live.url)
    monkeypatch.setenv("ASYNCINTERP_API_KEY", KEY)
    return "asyncinterp-remote-test"


def _text(cell):
    out = []
    for o in cell.outputs:
        if o.output_type == "stream":
            out.append(o.text)
        elif o.output_type == "execute_result":
            out.append(o.data.get("text/plain", ""))
        elif o.output_type == "error":
            out.append(f"ERROR {o.ename}: {o.evalue}")
    return "".join(out)


def test_the_notebook_starts_no_server_and_defines_its_helpers_in_cells():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    sources = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "ai.remote(url, api_key=key)" in sources and 'os.environ.get("ASYNCINTERP_URL"' in sources
    assert "Server(" not in sources and "subprocess" not in sources and "asyncio.run" not in sources
    for helper in ("LAYER = 1", "def last_position(", "def steering(", "ai.Future()", "m.steps()",
                   "lm.session(sweep)", "await lm.atrace(", "torch.autograd.grad"):
        assert helper in sources, helper


@pytest.mark.slow
def test_the_remote_notebook_runs_in_a_kernel_with_local_results(kernel, live):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    before = dict(live.server.batcher.stats)
    client = nbclient.NotebookClient(nb, kernel_name=kernel, timeout=300,
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()
    texts = [_text(c) for c in nb.cells if c.cell_type == "code"]
    joined = "\n".join(texts)
    assert "ERROR" not in joined, joined
    assert "served: GPT2LMHeadModel, allow_code=True" in texts[0]
    equal = [line.split(":")[0] for line in joined.splitlines() if line.endswith(": remote equals local")]
    assert equal == ["constant and helper", "steering closure", "activation patching",
                     "per-step generation (steps)", "per-step generation (tokens)", "per-step generation (text)",
                     "session", "session with keywords", "top-level await", "gradients"], joined
    assert "the steering changed the logits: True" in joined
    # the jobs really ran on the server (not only in the kernel)
    assert live.server.batcher.stats["requests"] - before["requests"] >= 8
