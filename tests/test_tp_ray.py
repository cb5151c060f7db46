"""Tensor parallel 2 with the ranks as Ray actors on two nodes (``RayRanks``): TP=2 across nodes equals TP=1.

The module builds one local multi-node Ray cluster (``ray.cluster_utils.Cluster``:
a head node with no CPUs and two worker nodes with one CPU each, so the
``STRICT_SPREAD`` placement group puts rank 0 and rank 1 on different nodes)
and runs the launcher's own per-rank script, ``tests/tp_checks.py``, on the
two Ray ranks: gloo across the nodes, ``tp_plan="auto"``. The checks on what
the ranks measured are the very tests of ``tests/test_tp.py`` (imported
below, same tolerance 1e-5): every module's input and output and every
semantic point equal TP=1, in-place edits and replacements give TP=1's
logits, a generation with a per-step edit gives TP=1's tokens, and an
exception on one rank is a clear error on rank 0 well inside the collective
timeout.

The Ray-only behaviour is tested after: the ranks sit on two different
non-head nodes, a rank's error comes back with its traceback, killing a rank's
actor ends the wait with ``RanksLostError`` (not a hang) and leaves no actor,
a job past its timeout is killed, and a cluster with too few nodes is a
``PlacementError`` that says what it lacks. Every wait is bounded.
"""

import json
import os
import textwrap
import time

import pytest

pytest.importorskip("ray")
import ray  # noqa: E402

from asyncinterp.distributed.ray_ranks import NAMESPACE, PlacementError, RanksLostError, RayRanks  # noqa: E402
from ray_helpers import stop_cluster, two_node_cluster  # noqa: E402
# the launcher's checks, asserted on what the Ray ranks measured (pytest collects them here under this module)
from test_tp import (  # noqa: E402,F401
    test_a_failing_rank_is_a_clear_error_on_rank_0, test_activation_cache_during_generation,
    test_column_and_row_parallel_layers, test_every_module_input_and_output_equals_tp1_in_both_grad_modes,
    test_generation_with_per_step_edit_gives_tp1_tokens, test_in_place_edit_and_replacement_give_tp1_logits,
    test_local_shard_only_when_asked, test_sampling_without_a_seed_draws_the_same_tokens_on_every_rank,
    test_semantic_points_of_every_layer_equal_tp1_per_invoke, test_the_tp_model_is_recognised)

pytestmark = [pytest.mark.ray, pytest.mark.tp, pytest.mark.slow]

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def cluster():
    c, nodes = two_node_cluster(NAMESPACE)
    try:
        yield c, nodes
    finally:
        stop_cluster(c)


@pytest.fixture(scope="module")
def checks_job(cluster, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp-ray")
    job = RayRanks(nproc=2, collective_timeout=60, env=ENV).run([os.path.join(HERE, "tp_checks.py"), str(out)],
                                                                timeout=400)
    assert job.ok, f"ranks ended with {job.returncodes}\n--- rank 0:\n{job.output(0)[-6000:]}\n" \
                   f"--- rank 1:\n{job.output(1)[-3000:]}"
    return job, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def ranks(checks_job):
    return checks_job[1]        # what test_tp's tests read: per rank, the checks' results


def script(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def live_rank_actors() -> list:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a.get("namespace") == NAMESPACE and "-rank" in a["name"]]


def test_the_ranks_sit_on_two_different_worker_nodes(cluster, checks_job):
    c, nodes = cluster
    job, _ = checks_job
    placed = [n["node_id"] for n in job.nodes]
    assert len(set(placed)) == 2
    assert set(placed) == {n.node_id for n in nodes}              # the two worker nodes, never the head
    assert job.master == f"{job.nodes[0]['ip']}:{job.nodes[0]['port']}"   # rank 0's node hosts the rendezvous
    assert live_rank_actors() == []                                # the actors ended with the job


def test_an_error_on_a_rank_comes_back_with_its_traceback(cluster, tmp_path):
    path = script(tmp_path, "fails.py", """\
        import os, sys
        from asyncinterp import distributed as tp
        tp.init()
        if tp.rank() == 1:
            raise KeyError("no weights here on rank " + os.environ["RANK"])
        sys.exit(0)
        """)
    t0 = time.monotonic()
    job = RayRanks(nproc=2, env=ENV).run([path], timeout=120, grace=5)
    assert not job.ok and job.returncodes == [0, 1]
    assert "KeyError: 'no weights here on rank 1'" in job.output(1) and "fails.py" in job.output(1)
    assert time.monotonic() - t0 < 60 and live_rank_actors() == []


def test_killing_a_rank_actor_is_ranks_lost_not_a_hang(cluster, tmp_path):
    path = script(tmp_path, "spin.py", """\
        import torch, torch.distributed as dist
        from asyncinterp import distributed as tp
        tp.init(timeout=600)                 # a long collective timeout: only the loss can end the wait soon
        x = torch.ones(4)
        while True:
            dist.all_reduce(x)
        """)
    ranks = RayRanks(nproc=2, env=ENV)
    job = ranks.start([path])
    time.sleep(2.0)
    assert job.poll(0.5) is None                           # both ranks are running their collectives
    ray.kill(ranks.actors[1], no_restart=True)
    t0 = time.monotonic()
    with pytest.raises(RanksLostError) as info:
        job.wait(timeout=120)
    assert time.monotonic() - t0 < 30
    assert info.value.ranks == [1]
    assert "was lost" in str(info.value) and "other ranks are stopped" in str(info.value)
    deadline = time.monotonic() + 20
    while live_rank_actors() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live_rank_actors() == []


def test_a_job_past_its_timeout_is_killed(cluster, tmp_path):
    path = script(tmp_path, "sleeps.py", "import time\ntime.sleep(600)\n")
    t0 = time.monotonic()
    job = RayRanks(nproc=2, env=ENV).run([path], timeout=3)
    assert job.timed_out and job.returncodes == [124, 124]
    assert time.monotonic() - t0 < 30 and live_rank_actors() == []


def test_too_few_nodes_is_a_clear_placement_error(cluster, tmp_path):
    t0 = time.monotonic()
    with pytest.raises(PlacementError, match=r"3 ranks .*STRICT_SPREAD needs 3 nodes") as info:
        RayRanks(nproc=3, placement_timeout=3).run(["-m", "json.tool", "--help"], timeout=30)
    assert time.monotonic() - t0 < 20
    assert "Add nodes, or use fewer ranks" in str(info.value)
