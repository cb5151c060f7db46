"""A harvest on Ray Data (issue 32 item 8): 2 engine actors on a 2-node local cluster write what one process writes.

One ``ray.cluster_utils.Cluster`` for the module (tests/ray_helpers.py: a head with no CPUs, two one-CPU worker
nodes, so the two actors land on different nodes). The reference is the same harvest in this process. Checked:

* every file of the output (shards, the reductions' state after each shard, results, index, manifest) has the
  same sha256 as the one-process run, and the reductions' results are bit-equal;
* an actor SIGKILLed mid-run is restarted by Ray Data and its block redone: the files are still identical, no
  temporary file is left, and no shard was lost;
* a driver SIGKILLed mid-run and started again with the same arguments computes only the missing shards and
  ends byte-identical.
"""

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

pytest.importorskip("ray")
import ray  # noqa: E402

import asyncinterp as ai  # noqa: E402
from asyncinterp.harvesting.on_ray import RayOptions, Rebuild  # noqa: E402
from asyncinterp.harvesting.reductions import Histogram, MeanVar, TopK  # noqa: E402
from harvest_helpers import corpus, sha256_tree, write_jsonl  # noqa: E402
from ray_helpers import stop_cluster, two_node_cluster  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

POINT = "blocks.1.hook_resid_post"
OPTIONS = dict(context_size=16, batch_size=4, shard_windows=8, progress=False)


def reductions():
    return [MeanVar(POINT), TopK(POINT, k=4), TopK(POINT, k=2, directions=torch.linspace(-1, 1, 64)),
            Histogram(POINT, bins=16, range=(-4.0, 4.0))]


class Recorded:
    """A model factory for the actors: the driver's model (by value), recording each actor's pid and node, and
    optionally slowed down (a sleep before each forward) so that a kill lands mid-run."""

    def __init__(self, model, where, delay=0.0):
        self.rebuild = Rebuild(model)
        self.where = str(where)
        self.delay = delay

    def __call__(self):
        node = ray.get_runtime_context().get_node_id()
        with open(os.path.join(self.where, f"actor-{os.getpid()}"), "w") as f:
            f.write(node)
        model = self.rebuild()
        if self.delay:
            delay = self.delay
            model.module.register_forward_pre_hook(lambda *_: time.sleep(delay))
        return model


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the actors cannot import this test module


@pytest.fixture(scope="module")
def cluster():
    c, _ = two_node_cluster()
    try:
        yield c
    finally:
        stop_cluster(c)


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    return ai.models.tiny("gpt2")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "docs.jsonl", corpus(100))


@pytest.fixture(scope="module")
def reference(lm, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "out"
    result = ai.harvest(lm, data, [POINT], str(out), reductions=reductions(), **OPTIONS)
    assert result.shards >= 8
    return out, result


def shards_on_disk(out):
    """The completed shards' data files in ``out`` (not the temporary files of a write under way)."""
    return sorted(n for n in (os.listdir(out) if out.exists() else []) if re.fullmatch(r"data-\d{5}\.arrow", n))


def actors_seen(where):
    out = {}
    for name in os.listdir(where):
        if name.startswith("actor-"):
            with open(os.path.join(where, name)) as f:
                out[int(name[6:])] = f.read()
    return out


def assert_same_results(got, want):
    assert got.keys() == want.keys()
    for name in want:
        for key in want[name]:
            assert torch.equal(got[name][key], want[name][key]), (name, key)


def test_two_actors_on_two_nodes_write_the_same_files_as_one_process(cluster, lm, data, reference, tmp_path):
    ref_dir, ref = reference
    where = tmp_path / "actors"
    where.mkdir()
    out = tmp_path / "out"
    got = ai.harvest(lm, data, [POINT], str(out), reductions=reductions(),
                     ray=RayOptions(actors=2, model=Recorded(lm, where)), **OPTIONS)
    assert sha256_tree(out) == sha256_tree(ref_dir)
    assert_same_results(got.reductions, ref.reductions)
    assert got.computed_shards == got.shards == ref.shards and got.windows == ref.windows
    nodes = set(actors_seen(where).values())
    assert len(nodes) == 2 and ray.get_runtime_context().get_node_id() not in nodes   # one actor per worker node


def test_a_killed_actor_has_its_block_redone_and_the_files_are_still_identical(cluster, lm, data, reference, tmp_path):
    ref_dir, ref = reference
    where = tmp_path / "actors"
    where.mkdir()
    out = tmp_path / "out"
    killed = {}

    def kill_one():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            shards = shards_on_disk(out)
            actors = actors_seen(where)
            if len(shards) >= 2 and actors:
                pid = min(actors)
                killed.update(pid=pid, shards_then=len(shards))
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_one)
    killer.start()
    got = ai.harvest(lm, data, [POINT], str(out), reductions=reductions(),
                     ray=RayOptions(actors=2, model=Recorded(lm, where, delay=0.05)), **OPTIONS)
    killer.join(timeout=10)
    assert killed, "the actor was never killed"
    assert killed["shards_then"] < ref.shards                 # it died mid-run, inside a block ...
    with pytest.raises(ProcessLookupError):
        os.kill(killed["pid"], 0)
    assert got.shards == ref.shards                            # ... which another actor (or its restart) redid
    assert sha256_tree(out) == sha256_tree(ref_dir)            # nothing lost, nothing half-written, same bytes
    assert_same_results(got.reductions, ref.reductions)


DRIVER = textwrap.dedent("""
    import sys, torch
    sys.path[:0] = [{tests!r}]
    import asyncinterp as ai
    import test_harvest_ray as t
    torch.manual_seed(0)
    lm = ai.models.tiny("gpt2")
    ai.harvest(lm, {data!r}, [t.POINT], {out!r}, reductions=t.reductions(),
               ray=t.RayOptions(address={address!r}, actors=2, model=t.Recorded(lm, {where!r}, delay=0.05)),
               **t.OPTIONS)
""")


def test_a_killed_driver_resumes_with_only_the_missing_shards(cluster, lm, data, reference, tmp_path):
    ref_dir, ref = reference
    where = tmp_path / "actors"
    where.mkdir()
    out = tmp_path / "out"
    script = DRIVER.format(tests=os.path.dirname(__file__), data=data, out=str(out), address=cluster.address,
                           where=str(where))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            done = shards_on_disk(out)
            if len(done) >= 3:
                break
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            time.sleep(0.05)
        else:
            raise AssertionError("the driver wrote no shard in time")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    time.sleep(2)                                             # its actors die with their driver
    partial = shards_on_disk(out)
    assert 3 <= len(partial) < ref.shards
    got = ai.harvest(lm, data, [POINT], str(out), reductions=reductions(), ray=RayOptions(actors=2), **OPTIONS)
    assert got.resumed_shards >= len(partial)                  # the shards on disk are not computed again
    assert got.computed_shards == ref.shards - got.resumed_shards
    assert sha256_tree(out) == sha256_tree(ref_dir)
    assert_same_results(got.reductions, ref.reductions)


def test_the_page_runs_on_the_cluster(cluster):
    """docs/harvest-reductions.md, every block (its Ray block on this module's two-node cluster)."""
    from docsnippets import run_page
    ns = run_page("harvest-reductions.md")
    assert ns["spread"].computed_shards == ns["spread"].shards == ns["local"].shards


def test_a_worker_never_writes_a_complete_shard_twice(lm, tmp_path):
    """A retried block whose shard is on disk (data and reductions' state) is answered without writing."""
    from asyncinterp.harvesting.on_ray import ShardWorker
    from asyncinterp.harvesting.points import PointSpec
    from asyncinterp.harvesting.store import Store
    import numpy as np
    out = tmp_path / "out"
    Store(str(out)).open({"format": "test"})
    ids = np.arange(8 * 16, dtype=np.int32).reshape(8, 16) % 90
    worker = ShardWorker(Rebuild(lm), {3: ids}, [PointSpec(POINT, POINT)], slice(None), "float32", 16, 4, 8,
                         reductions(), True, True, str(out), None)
    first = worker({"shard": np.array([3])})
    names = sorted(os.listdir(out))
    assert bool(first["computed"][0]) and "data-00003.arrow" in names and "reductions-part-00003.safetensors" in names
    stamps = {n: os.stat(out / n).st_mtime_ns for n in names}
    again = worker({"shard": np.array([3])})
    assert not bool(again["computed"][0])
    assert {n: os.stat(out / n).st_mtime_ns for n in sorted(os.listdir(out))} == stamps


def test_a_run_past_its_timeout_is_an_error(cluster, lm, data, tmp_path):
    """(Last in the module: the abandoned run's actors go with the cluster.)"""
    out = tmp_path / "out"
    with pytest.raises(TimeoutError, match="past its timeout of 4 s"):
        ai.harvest(lm, data, [POINT], str(out), reductions=reductions(),
                   ray=RayOptions(actors=1, timeout=4, model=Recorded(lm, tmp_path, delay=0.2)), **OPTIONS)
