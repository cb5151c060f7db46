"""docs/serving.md's Python session runs against a real server; the serve examples run."""

import asyncio
import linecache
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from asyncinterp.models import tiny
from docsnippets import python_blocks

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model():
    return tiny("llama", num_hidden_layers=8)


def test_serving_doc_session(model):
    from asyncinterp.serve import Server
    from test_serve_http import Live
    live = Live(Server(model, api_keys=["secret"], allow_code=True))
    try:
        ns = {"__name__": "__docs__"}
        blocks = python_blocks("serving.md")
        assert len(blocks) >= 7
        for i, block in enumerate(blocks):
            block = block.replace('"http://127.0.0.1:8000"', repr(live.url))
            name = f"serving.md[block {i}]"
            # like IPython cells: registered in linecache, so inspect.getsource finds client functions
            linecache.cache[name] = (len(block), None, block.splitlines(True), name)
            exec(compile(block, name, "exec"), ns)  # noqa: S102 - our docs
            for edit in ("calm", "honest"):    # the page's edits.py, installed as `--edit NAME=edits.py:NAME` does
                if edit in ns and edit not in live.server.names.edits:
                    live.server.add_edit(edit, ns[edit])
        # the registration block defines register(server); the batching block defines main(model)
        server = Server(model)
        ns["register"](server)
        assert "scale" in server.interventions
        results = asyncio.run(ns["main"](model))
        assert len(results) == 100 and all(isinstance(r, torch.Tensor) for r in results)

        async def read(m):
            return (await m.lm_head.output)[:, -1].clone()

        async def job_of_two():   # the page's job goes to the front as it is, and answers as locally
            from asyncinterp.serve import Batcher
            async with Batcher(model) as batcher:
                return await ns["two_reads"](batcher, read)
        outcomes = asyncio.run(job_of_two())
        with model.trace() as tr:
            a, b = tr.invoke("The cat sat on the", read), tr.invoke("Paris is the", read)
        assert [ok for ok, _ in outcomes] == [True, True]
        assert torch.allclose(outcomes[0][1], a.result, atol=1e-5)
        assert torch.allclose(outcomes[1][1], b.result, atol=1e-5)
    finally:
        live.close()


@pytest.mark.parametrize("script", ["serve_quickstart.py", "serve_batcher.py"])
def test_serve_examples_run(script):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, script, "--model", "tiny"], cwd=ROOT / "examples", env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    if script == "serve_quickstart.py":
        assert "refused (400): import of 'os' is not allowed" in out.stdout
        assert "remote IndexError (422)" in out.stdout
    else:
        assert "largest difference to running alone" in out.stdout
