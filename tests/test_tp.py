"""Tensor parallel 2 on transformers (``tp_plan="auto"``) and on column/row-parallel layers: TP=2 equals TP=1.

One 2-process job (gloo, CPU) runs ``tests/tp_checks.py`` for the whole
module (the launcher starts it, the module fixture waits for it): every
module's input and output, every semantic point of every layer, in-place
edits and replacements of sharded and replicated values, a generation with a
per-step edit, the activation cache, the explicit local shard, GPT-2 (which
has no TP plan in this transformers) and a rank that fails on purpose. Each
rank compares with the same weights loaded unsharded in its own process; the
tests below assert on what rank 0 (and rank 1) measured.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from asyncinterp.distributed.launch import launch

pytestmark = pytest.mark.tp

HERE = os.path.dirname(os.path.abspath(__file__))
TOL = 1e-5


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    job = launch([os.path.join(HERE, "tp_checks.py"), str(out)], nproc=2, timeout=600, collective_timeout=60,
                 env=env)
    assert job.alive() == [], "the launcher left a rank running"
    assert job.ok, f"ranks exited with {job.returncodes}\n--- rank 0:\n{job.output(0)[-6000:]}\n" \
                   f"--- rank 1:\n{job.output(1)[-3000:]}"
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return results


def result(ranks, name, rank=0):
    got = ranks[rank][name]
    assert "error" not in got, got["error"]
    return got


def test_the_tp_model_is_recognised(ranks):
    assert ranks[0]["wrapped"] == ranks[1]["wrapped"] == "ShardedLanguageModel"


def test_every_module_input_and_output_equals_tp1_in_both_grad_modes(ranks):
    for rank in (0, 1):
        got = result(ranks, "llama_every_module", rank)
        for mode in ("grad", "no_grad"):
            g = got[mode]
            assert g["keys"] == g["keys_tp"] and g["keys"] > 50
            assert g["shape_mismatch"] == [], g["shape_mismatch"]   # never a shard where TP=1 has the full tensor
            assert g["max_diff"] < TOL
            assert g["sharded_seen"]                                 # the column-parallel outputs were among them


def test_semantic_points_of_every_layer_equal_tp1_per_invoke(ranks):
    got = result(ranks, "llama_points")
    assert got["points"] == 38 and got["shape_mismatch"] == []
    assert got["max_diff"] < TOL
    assert got["q_shape"][2] == 4        # all 4 heads, not this rank's 2


def test_in_place_edit_and_replacement_give_tp1_logits(ranks):
    for rank in (0, 1):
        got = result(ranks, "llama_edits", rank)
        for case in ("edit_in_place", "edit_replace"):
            assert got[case]["max_diff"] < TOL, (case, got[case])
            assert got[case]["effect"] > 1e-3, (case, got[case])    # the edit did change the logits


def test_local_shard_only_when_asked(ranks):
    for rank in (0, 1):
        got = result(ranks, "llama_local_shard", rank)
        assert got["full"][-1] == 64 and got["local"][-1] == 32
        assert got["is_my_slice"]


def test_generation_with_per_step_edit_gives_tp1_tokens(ranks):
    got = result(ranks, "llama_generate")
    assert got["tokens_tp2"] == got["tokens_tp1"]
    assert got["tokens_tp1"] != got["plain"]                           # the per-step edit mattered
    assert got["q_shapes_tp2"] == got["q_shapes_tp1"]
    assert all(s[-1] == 64 for s in got["q_shapes_tp2"])


def test_sampling_without_a_seed_draws_the_same_tokens_on_every_rank(ranks):
    assert result(ranks, "llama_sampling", 0)["tokens"] == result(ranks, "llama_sampling", 1)["tokens"]


def test_activation_cache_during_generation(ranks):
    got = result(ranks, "llama_generate_cache")
    assert got["steps"] == [3, 3] and got["shapes"][0] == got["shapes"][1]
    assert got["max_diff"] < TOL


def test_column_and_row_parallel_layers(ranks):
    got = result(ranks, "colrow")
    assert got["shapes_equal"], got["shapes"]
    assert got["max_diff"] < TOL and got["edit_diff"] < TOL and got["edit_effect"] > 1e-3
    assert got["local"] == [3, 8] and got["full_down_input"] == [3, 16]


def test_a_dtensor_value_is_gathered_and_rebuilt(ranks):
    for rank in (0, 1):
        got = result(ranks, "dtensor", rank)
        assert got["type"] == "Tensor" and got["shape"] == [2, 6] and got["equal_input"]
        assert got["after_edit"]            # both ranks' columns edited, seen downstream through the DTensor


def test_gpt2_has_no_plan_and_runs_replicated(ranks):
    got = result(ranks, "gpt2_plan")
    # transformers 5.19 has no TP plan for GPT-2: tp_plan="auto" loads whole weights on every rank
    assert got["loaded"] and got["sharded_params"] == 0 and got["plan"] == {}
    assert got["wrapped"] == "LanguageModel" and got["reads_equal"]


def test_docs_page_runs_on_two_ranks(ranks):
    for rank in (0, 1):
        got = result(ranks, "docs_page", rank)
        assert got["blocks"] >= 4
    assert ranks[0]["docs_page"]["generated"] == ranks[1]["docs_page"]["generated"]


def test_a_failing_rank_is_a_clear_error_on_rank_0(ranks):
    zero, one = ranks[0]["failure"], ranks[1]["failure"]
    assert one["raised"] == "ValueError"                               # the failing rank: its own exception
    assert zero["raised"] == "RankFailedError" and zero["failures"] == [1]
    assert "boom on rank 1" in zero["message"] and "rank 1" in zero["message"]
    assert zero["seconds"] < 60                                        # not a hang; well inside the timeout


def test_launcher_kills_a_hung_job_and_leaves_nothing(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent("""\
        import os, time
        print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], flush=True)
        if os.environ["RANK"] == "1":
            time.sleep(600)
        """))
    job = launch([str(script)], nproc=2, timeout=5)
    assert job.timed_out and job.alive() == []
    assert job.returncodes[0] == 0 and job.returncodes[1] == 124
    assert "rank 0 of 2" in job.output(0) and "rank 1 of 2" in job.output(1)


def test_launcher_cli_runs_one_command(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("import os, sys\nsys.exit(int(os.environ['RANK']) * 3)\n")
    out = subprocess.run([sys.executable, "-m", "asyncinterp.distributed.launch", "--nproc", "2", "--timeout", "60",
                          str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 3        # the failed rank's status
