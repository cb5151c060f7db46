"""Harvest reductions under vLLM tensor parallelism: reduced in the worker processes, only their state comes back.

Under ``tensor_parallel_size=2`` vLLM runs interventions in two worker processes (shipped by
``collective_rpc``), so the activations never exist in the driver. A harvest with ``save_activations=False``
reduces each window there (``harvesting/in_engine.py``) and gets back the reductions' state from rank 0.
Checked against the same harvest at TP=1, within the TP parity tolerance (tests/test_vllm_tp.py's).
"""

import pytest
import torch

import asyncinterp as ai
from asyncinterp.harvesting.reductions import Histogram, MeanVar, TopK
from harvest_helpers import corpus, write_jsonl
from vllm_helpers import ENGINE, make_tiny_dir, require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

POINT = "blocks.1.hook_resid_post"


def reductions():
    return [MeanVar(POINT), TopK(POINT, k=3), Histogram(POINT, bins=12, range=(-6.0, 6.0))]


def test_tp2_reductions_equal_tp1(tmp_path):
    require_vllm()
    path = make_tiny_dir(tmp_path / "model", seed=1)
    data = write_jsonl(tmp_path / "docs.jsonl", corpus(30))
    results = {}
    for tp in (2, 1):                           # one engine per process at a time
        model = ai.VLLM(path, tensor_parallel_size=tp, **ENGINE)
        try:
            assert model.tp == tp
            results[tp] = ai.harvest(model, data, [POINT], str(tmp_path / f"tp{tp}"), reductions=reductions(),
                                     save_activations=False, context_size=16, batch_size=4, shard_windows=8,
                                     max_windows=16, progress=False)
        finally:
            model.close()
    one, two = results[1].reductions, results[2].reductions
    h = Histogram(POINT, bins=12, range=(-6.0, 6.0)).name
    assert one.keys() == two.keys() and results[1].windows == results[2].windows == 16
    for name in one:
        for key, want in one[name].items():
            got = two[name][key]
            if want.is_floating_point():
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4,
                                           msg=lambda s, n=name, k=key: f"{n} {k}: {s}")
            elif name != h:                          # window ids and positions: the same windows win
                assert torch.equal(got, want), (name, key)
    totals = [int(r[h]["counts"].sum() + r[h]["below"] + r[h]["above"] + r[h]["nan"]) for r in (one, two)]
    assert totals[0] == totals[1] > 0                                    # every value counted once
    assert int((one[h]["counts"] - two[h]["counts"]).abs().sum()) <= 4   # (a value at a bin edge may move)
