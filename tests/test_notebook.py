"""examples/quickstart.ipynb runs in a real Jupyter kernel (nbclient + ipykernel) with top-level await."""

import json
import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = pathlib.Path(__file__).resolve().parent.parent / "examples" / "quickstart.ipynb"


@pytest.fixture
def venv_kernel(tmp_path, monkeypatch):
    """A kernelspec that starts ipykernel with this interpreter (the project's virtualenv)."""
    spec = tmp_path / "kernels" / "asyncinterp-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "asyncinterp test kernel", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    return "asyncinterp-test"


def _text(cell):
    out = []
    for o in cell.outputs:
        if o.output_type == "stream" and o.name == "stdout":
            out.append(o.text)
        elif o.output_type == "execute_result":
            out.append(o.data.get("text/plain", ""))
        elif o.output_type == "error":
            out.append(f"ERROR {o.ename}: {o.evalue}")
    return "".join(out)


def test_notebook_uses_top_level_await():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    sources = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "await model.atrace(" in sources and "await model.agenerate(" in sources
    assert "asyncio.run" not in sources


@pytest.mark.smollm2
def test_quickstart_notebook_executes(venv_kernel):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name=venv_kernel, timeout=300,
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    texts = [_text(c) for c in code]
    assert not any("ERROR" in t for t in texts), texts
    assert "LlamaForCausalLM" in texts[0]
    assert texts[1].strip() == "' Paris'"
    patch_line = texts[2]
    numbers = [float(x) for x in patch_line.split() if x.replace(".", "", 1).isdigit()]
    p_clean, p_corrupt, p_patched = numbers[:3]
    assert p_clean > 0.5 and p_corrupt < 0.01 and p_patched > 0.3
    assert "29:' Paris'" in texts[3]
    assert texts[4].startswith("' Paris")
    assert "plain:" in texts[5] and "steered:" in texts[5]
    plain, steered = [line for line in texts[5].splitlines() if line]
    assert plain.split(":", 1)[1] != steered.split(":", 1)[1]
