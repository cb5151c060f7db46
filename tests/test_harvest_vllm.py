"""ai.harvest on vLLM: prompt-only requests through vLLM's scheduler give the values of transformers (and of a
hand-written hook) on the same windows within the parity tolerance, also when vLLM splits prompts into chunks,
and the directory has the same layout and windows."""

import os

import numpy as np
import pytest
import torch

import asyncinterp as ai
from harvest_helpers import corpus, hook_values, sha256_tree
from vllm_helpers import ENGINE, hf_model, require_vllm  # noqa: F401
from vllm_helpers import tiny_dir  # noqa: F401 - fixtures are found by name

pytestmark = pytest.mark.vllm

POINTS = ["blocks.1.hook_resid_post", "layers.0.mlp.post", "blocks.0.attn.hook_q"]
CTX = 24


@pytest.fixture(scope="module")
def engines(tiny_dir):
    # a small step budget: vLLM splits some prompts over two engine steps (chunked prefill)
    vm = ai.VLLM(tiny_dir, **{**ENGINE, "max_num_batched_tokens": 64, "max_num_seqs": 8})
    lm = ai.LanguageModel(hf_model(tiny_dir), vm.tokenizer)
    yield lm, vm
    vm.close()


@pytest.fixture(scope="module")
def data():
    import datasets
    return datasets.Dataset.from_dict({"text": corpus(40, seed=3)})


def _stack(h, column):
    return torch.stack([h[i][column] for i in range(len(h))]).float()


def test_vllm_harvest_equals_transformers_and_hooks(engines, data, tmp_path):
    lm, vm = engines
    kw = dict(context_size=CTX, batch_size=8, shard_windows=16, progress=False)
    rv = ai.harvest(vm, data, POINTS, tmp_path / "vllm", **kw)
    rt = ai.harvest(lm, data, POINTS, tmp_path / "hf", **kw)
    assert rv.windows == rt.windows and rv.shards == rt.shards >= 2
    v, t = ai.harvest.open(rv.path), ai.harvest.open(rt.path)
    assert v.columns == t.columns
    assert torch.equal(_stack(v, "token_ids"), _stack(t, "token_ids"))
    for col in v.columns[:-1]:
        torch.testing.assert_close(_stack(v, col), _stack(t, col), rtol=1e-4, atol=1e-4, msg=lambda s: f"{col}: {s}")
    # and a plain forward hook on the transformers model, on the windows the vLLM harvest stored
    ids = _stack(v, "token_ids").long()[:8]
    ref = hook_values(lm.module, ids, {"r": (lm.module.model.layers[1], "output")})
    torch.testing.assert_close(_stack(v, "blocks.1.hook_resid_post")[:8], ref["r"], rtol=1e-4, atol=1e-4)
    assert v.manifest["engine"] == "vllm" and v.manifest["model"]["weights_sha256"]


def test_vllm_harvest_resumes_byte_identical(engines, data, tmp_path):
    _, vm = engines
    kw = dict(context_size=CTX, batch_size=8, shard_windows=16, progress=False, positions="last", dtype="bf16")
    ai.harvest(vm, data, POINTS[:1], tmp_path / "a", **kw)
    ai.harvest(vm, data, POINTS[:1], tmp_path / "b", **kw)
    for name in os.listdir(tmp_path / "b"):
        if name.startswith("data-0000") and int(name[5:10]) >= 1 or name == "state.json":
            os.remove(tmp_path / "b" / name)
    again = ai.harvest(vm, data, POINTS[:1], tmp_path / "b", **kw)
    assert again.resumed_shards == 1
    assert sha256_tree(tmp_path / "a") == sha256_tree(tmp_path / "b")
    h = ai.harvest.open(tmp_path / "a")
    assert h[0]["blocks.1.hook_resid_post"].shape == (1, 64) and h[0]["blocks.1.hook_resid_post"].dtype == torch.bfloat16
    assert np.isfinite(_stack(h, "blocks.1.hook_resid_post").numpy()).all()
