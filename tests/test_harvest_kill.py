"""The must-show of resumability: `asyncinterp harvest` SIGKILLed at three random moments, then rerun, ends
byte-identical (sha256 per file) to an uninterrupted run, recomputing at most the one shard in flight per kill."""

import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

from harvest_helpers import corpus, sha256_tree, write_jsonl

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cmd(model_dir, data, out):
    return [sys.executable, "-m", "asyncinterp.cli", "harvest", str(model_dir), "--dataset", str(data),
            "--points", "blocks.1.hook_resid_post,layers.0.mlp.post", "--out", str(out), "--context-size", "32",
            "--batch-size", "4", "--shard-windows", "8", "--no-progress"]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _shards(out):
    return sorted(n for n in os.listdir(out) if re.fullmatch(r"data-\d{5}\.arrow", n)) if os.path.isdir(out) else []


def test_sigkill_three_times_then_resume_is_byte_identical(tmp_path):
    from asyncinterp.models.hf.bundled import tiny_llama_dir
    model_dir = tiny_llama_dir(tmp_path / "model", seed=0, num_hidden_layers=3)
    data = write_jsonl(tmp_path / "docs.jsonl", corpus(160, seed=1))
    ref = tmp_path / "ref"
    done = subprocess.run(_cmd(model_dir, data, ref), env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    n_ref = len(_shards(ref))
    assert n_ref >= 20

    out = tmp_path / "out"
    rng = random.Random(20261204)
    log = []
    for kill in range(3):
        before = len(_shards(out))
        proc = subprocess.Popen(_cmd(model_dir, data, out), env=_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            # wait until this run is past its start-up and has written a new shard, then kill at a random moment
            deadline = time.monotonic() + 300
            while len(_shards(out)) <= before and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 0.8))
            assert proc.poll() is None, "the run finished before it could be killed: give it more data"
            proc.send_signal(signal.SIGKILL)
            text = proc.communicate(timeout=60)[0]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        on_disk = len(_shards(out))
        log.append((before, on_disk))
        resumed = re.search(r"resuming .* at shard (\d+)", text)
        assert (int(resumed.group(1)) if resumed else 0) == before, text[-2000:]   # no complete shard redone
        assert "state.json" not in os.listdir(out)

    final = subprocess.run(_cmd(model_dir, data, out), env=_env(), capture_output=True, text=True, timeout=600)
    assert final.returncode == 0, final.stderr[-3000:]
    start = int(re.search(r"resuming .* at shard (\d+)", final.stdout + final.stderr).group(1))
    assert start == log[-1][1]          # every shard complete at the last kill was kept; only the one in flight redone
    assert all(b < a < n_ref for b, a in log), log
    assert sha256_tree(out) == sha256_tree(ref)
    assert not [n for n in os.listdir(out) if ".tmp-" in n]
