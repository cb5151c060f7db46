"""ai.harvest on a tensor-parallel transformers model (2 ranks, gloo): sharded points are gathered, rank 0 alone
writes, and the values equal an unsharded harvest of the same windows within the parity tolerance."""

import os

import pytest
import torch

import asyncinterp as ai
from asyncinterp.distributed.launch import launch
from harvest_helpers import corpus, write_jsonl

pytestmark = [pytest.mark.tp, pytest.mark.slow]

HERE = os.path.dirname(os.path.abspath(__file__))
POINTS = ["blocks.1.hook_resid_post", "layers.0.attn.q", "layers.1.mlp.post"]


def test_tp2_harvest_equals_tp1(tmp_path):
    import sys
    sys.path.insert(0, HERE)
    from tp_checks import build_llama_dir
    model_dir = str(tmp_path / "llama")
    build_llama_dir(model_dir)
    data = write_jsonl(tmp_path / "docs.jsonl", corpus(30, seed=5))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.path.join(os.path.dirname(HERE), "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    job = launch([os.path.join(HERE, "harvest_tp_script.py"), model_dir, data, str(tmp_path / "tp2")], nproc=2,
                 timeout=600, collective_timeout=60, env=env)
    assert job.alive() == []
    assert job.ok, f"{job.returncodes}\n{job.output(0)[-4000:]}\n{job.output(1)[-2000:]}"
    assert "engine transformers-tp2" in job.output(1)             # rank 1 ran every batch too
    one = ai.LanguageModel.from_pretrained(model_dir, attn_implementation="eager")
    ref = ai.harvest(one, data, POINTS, tmp_path / "tp1", context_size=16, batch_size=4, shard_windows=8,
                     progress=False)
    a, b = ai.harvest.open(ref.path), ai.harvest.open(tmp_path / "tp2")
    assert len(a) == len(b) == ref.windows and a.columns == b.columns
    assert b.manifest["engine"] == "transformers-tp2"
    for col in a.columns:
        x = torch.stack([a[i][col] for i in range(len(a))])
        y = torch.stack([b[i][col] for i in range(len(b))])
        assert x.shape == y.shape, col                            # full (gathered) tensors, not one rank's shard
        if col == "token_ids":
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5, msg=lambda s: f"{col}: {s}")
