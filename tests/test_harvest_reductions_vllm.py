"""Harvest reductions on vLLM, computed inside the engine's interventions (issue 32 item 7).

With ``save_activations=False`` on an ``ai.VLLM`` engine, each window's request runs an intervention that
reduces that window where the model runs and returns only the reductions' state. Checked against the same
reductions computed in the driver from the raw activations of the same engine (bit-equal: the same values,
and merging per-window states gives the same bits as updating batch by batch), and against the transformers
engine on the same weights (within the vLLM parity tolerance).
"""


import pytest
import torch

import asyncinterp as ai
from asyncinterp.harvesting.in_engine import window_reducer
from asyncinterp.harvesting.points import PointSpec
from asyncinterp.harvesting.reductions import Histogram, MeanVar, TopK
from harvest_helpers import corpus, sha256_tree, write_jsonl
from vllm_helpers import tiny_dir, engines  # noqa: F401 - fixtures are found by name

pytestmark = pytest.mark.vllm

POINT = "blocks.1.hook_resid_post"
OPTIONS = dict(context_size=16, batch_size=4, shard_windows=8, max_windows=24, progress=False)


def reductions():
    return [MeanVar(POINT), TopK(POINT, k=3), Histogram(POINT, bins=12, range=(-6.0, 6.0))]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "docs.jsonl", corpus(40))


def test_in_engine_reductions_equal_the_driver_side_ones_bit_for_bit(engines, data, tmp_path):
    lm, vm = engines
    inside = ai.harvest(vm, data, [POINT], str(tmp_path / "inside"), reductions=reductions(),
                        save_activations=False, **OPTIONS)
    outside = ai.harvest(vm, data, [POINT], str(tmp_path / "outside"), reductions=reductions(), **OPTIONS)
    assert inside.windows == outside.windows == 24
    assert inside.reductions.keys() == outside.reductions.keys()
    for name, res in outside.reductions.items():
        for key, value in res.items():
            assert torch.equal(inside.reductions[name][key], value), (name, key)
    a, b = sha256_tree(tmp_path / "inside"), sha256_tree(tmp_path / "outside")
    states = [n for n in b if n.startswith(("reductions-", "result-"))]
    assert states and all(a[n] == b[n] for n in states)            # the saved states too
    assert not any(n.startswith("data-") for n in a)               # nothing but reductions was written

    # the same weights on transformers: the same statistics within the vLLM parity tolerance
    tf = ai.harvest(lm, data, [POINT], str(tmp_path / "transformers"), reductions=reductions(),
                    save_activations=False, **OPTIONS)
    mv = f"mean_var.{POINT}"
    torch.testing.assert_close(inside.reductions[mv]["mean"], tf.reductions[mv]["mean"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(inside.reductions[mv]["var"], tf.reductions[mv]["var"], rtol=1e-4, atol=1e-4)
    top = f"top_k.{POINT}.k3"
    torch.testing.assert_close(inside.reductions[top]["values"], tf.reductions[top]["values"], rtol=1e-4, atol=1e-4)


def test_what_a_window_request_returns_is_the_reductions_state(engines):
    """The value that crosses from where the model runs to the driver: state dicts, no activations."""
    _, vm = engines
    ids = torch.tensor([vm.tokenizer.bos_token_id or 1] + list(range(5, 20)))
    specs = [PointSpec(POINT, POINT)]
    reds = reductions()
    with vm.generate(max_new_tokens=1, temperature=0.0) as run:
        inv = run.invoke(ids, window_reducer(specs, slice(None), 16, 7, ids, reds))
    states = inv.result
    assert isinstance(states, list) and len(states) == 3
    width = vm.llm.llm_engine.model_config.hf_config.hidden_size
    assert states[0]["means"].shape == (1, width) and states[0]["starts"].tolist() == [7]   # one window's mean
    assert states[1]["window_ids"].shape == (width, 1) and (states[1]["window_ids"] == 7).all()
    assert int(states[2]["counts"].sum() + states[2]["nan"]) == 16 * width
    for s in states:                          # nothing of the shape of the activations [16, width]
        assert all(tuple(t.shape[-2:]) != (16, width) for t in s.values())
