"""Capture of functions defined in notebook cells: their source exists only in linecache (IPython's cell cache).

A notebook cell has no file on disk: IPython compiles it under a made-up file
name and puts its lines in ``linecache``, which is where ``inspect.getsource``
(and so :mod:`asyncinterp.client.capture`) finds them. These tests define
functions that way, in a real IPython shell and by hand, with helpers and
constants in *other* cells, and check that they travel and give the local
result after the trip (``dry_run``); and that a function whose cell source is
gone is a clear ``TypeError``.
"""

import linecache

import pytest
import torch

import asyncinterp as ai
from asyncinterp.client.capture import describe
from asyncinterp.serve.jobs.dryrun import dry_run


@pytest.fixture
def model():
    torch.manual_seed(0)
    return ai.wrap(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4)))


def _cell(namespace, filename, source):
    """Run ``source`` as a notebook does: compiled under a file name that only linecache knows."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - the test's own cells


CELLS = [
    "import torch\nSCALE = 0.5\n\ndef halve(h):\n    return h * SCALE\n",
    "steer = torch.ones(4)\n\ndef steering(vector):\n    async def steered(m):\n"
    "        h = await m[0].output\n        m[0].output = halve(h) + vector\n"
    "        return (await m[2].output).clone()\n    return steered\n",
]


def _check_travels(model, steered):
    desc = describe(steered)
    assert [f["name"] for f in desc["functions"]] == ["steered", "halve"]
    assert "return h * SCALE" in desc["functions"][1]["source"]
    assert desc["functions"][1]["values"]["SCALE"] == ["=", 0.5]
    x = torch.randn(2, 4)
    local = model.trace(x, steered)
    run = model.trace()
    run.invoke(x, steered)
    assert torch.allclose(dry_run(model, run).results[0].result, local, atol=1e-6)


def test_functions_from_linecache_only_cells_travel_with_helpers_from_other_cells(model):
    ns = {"__name__": "__main__"}
    for i, cell in enumerate(CELLS):
        _cell(ns, f"/tmp/ipykernel_4242/{1000 + i}.py", cell)     # ipykernel's naming: no such file
    _check_travels(model, ns["steering"](ns["steer"]))


def test_functions_defined_in_a_real_ipython_shell_travel(model):
    interactiveshell = pytest.importorskip("IPython.core.interactiveshell")
    from traitlets.config import Config
    config = Config()
    config.HistoryManager.enabled = False        # no history database in the user's home
    shell = interactiveshell.InteractiveShell.instance(config=config)
    try:
        for cell in CELLS:
            result = shell.run_cell(cell, store_history=True)
            assert result.success, result.error_in_exec or result.error_before_exec
        steered = shell.user_ns["steering"](shell.user_ns["steer"])
        assert not steered.__code__.co_filename.endswith("test_capture_notebook.py")
        _check_travels(model, steered)
    finally:
        interactiveshell.InteractiveShell.clear_instance()


def test_a_cell_whose_source_is_gone_is_a_clear_error():
    ns = {"__name__": "__main__"}
    filename = "/tmp/ipykernel_4242/gone.py"
    _cell(ns, filename, "async def read(m):\n    return await m[0].output\n")
    del linecache.cache[filename]
    with pytest.raises(TypeError, match="cannot get the source of read.*notebook cell"):
        describe(ns["read"])
