"""Two Ray Serve replicas share one PostgreSQL job store; a replica killed mid-job leaves the job to the other.

A throwaway PostgreSQL (``initdb``/``pg_ctl`` in a temporary directory, :mod:`pg_helpers`), a local Ray
cluster of two one-CPU worker nodes (:mod:`ray_helpers`) and the real command line
``asyncinterp serve tiny-gpt2 --replicas 2 --database postgresql://...``. A long session (hundreds of
traces) is submitted without waiting; any replica answers its status; the replica that holds its lease
(read from the store) is killed with SIGKILL mid-job. Its lease runs out, the other replica takes the job
over (a compare-and-set claim) and runs it again from its start: it ends once, succeeded, its status
records the restart, and its result equals the same session run blocking.
"""

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch

pytest.importorskip("ray")
import asyncpg  # noqa: E402

import asyncinterp as ai  # noqa: E402
from jobs_helpers import long_session  # noqa: E402
from pg_helpers import PostgresServer  # noqa: E402
from ray_helpers import stop_cluster, two_node_cluster  # noqa: E402
from remote_helpers import free_port  # noqa: E402
from serve_helpers import stop_server  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

KEY = "replica-jobs-key"
REPLICA = "x-asyncinterp-replica"


def lease_owner(url, jid):
    async def read():
        conn = await asyncpg.connect(url)
        try:
            return await conn.fetchrow("SELECT state, lease_owner, attempts FROM asyncinterp_jobs WHERE id = $1", jid)
        finally:
            await conn.close()
    return asyncio.run(read())


def pid_of(worker: str) -> int:
    return int(worker.rsplit("-", 2)[1])


def test_replica_killed_mid_job_the_other_finishes_it(tmp_path):
    with PostgresServer() as pg:
        cluster, _ = two_node_cluster()
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "asyncinterp.serve.scale.replicas", "tiny-gpt2", "--api-key", KEY, "--allow-code",
               "--isolation", "thread", "--exact", "--deterministic", "--threads", "1", "--database", pg.url, "--job-lease", "3", "--timeout", "120",
               "--log-level", "warning", "--replicas", "2", "--ray-address", cluster.address, "--port", str(port),
               "--max-replicas-per-node", "1"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 180
            seen = set()
            while len(seen) < 2:          # both replicas up and answering
                assert proc.poll() is None, proc.stderr.read()[-3000:]
                assert time.monotonic() < deadline, "the replicas did not come up"
                try:
                    r = httpx.get(f"{url}/v1/health", timeout=5)
                    if r.status_code == 200:
                        seen.add(r.headers[REPLICA])
                except httpx.HTTPError:
                    pass
                time.sleep(0.3)
            lm = ai.remote(url, api_key=KEY, timeout=120)
            job = lm.session(long_session, blocking=False)
            deadline = time.monotonic() + 60
            while True:
                row = lease_owner(pg.url, job.id)
                if row["state"] == "running" and row["lease_owner"]:
                    break
                assert row["state"] in ("queued", "running") and time.monotonic() < deadline, dict(row)
                time.sleep(0.05)
            first = row["lease_owner"]
            answered = {}
            for _ in range(20):           # any replica answers the job's status
                r = httpx.get(f"{url}/v1/jobs/{job.id}", headers={"authorization": f"Bearer {KEY}"}, timeout=10)
                assert r.status_code == 200 and r.json()["id"] == job.id
                answered[r.headers[REPLICA]] = r.json()["state"]
            assert len(answered) == 2, answered
            time.sleep(0.5)
            os.kill(pid_of(first), signal.SIGKILL)        # the replica running the job, mid-job
            deadline = time.monotonic() + 90
            while True:
                row = lease_owner(pg.url, job.id)
                if row["lease_owner"] and row["lease_owner"] != first or row["state"] == "succeeded":
                    break
                assert time.monotonic() < deadline, dict(row)
                time.sleep(0.05)
            second = row["lease_owner"]
            st = job.wait(timeout=120)
            assert st.state == "succeeded" and st.attempts == 2 and len(st.restarts) == 1, st.info
            assert "lease expired" in st.restarts[0]["why"]
            if second is not None:
                assert pid_of(second) != pid_of(first)
            value = job.result(timeout=30)
            assert torch.equal(value, lm.session(long_session))      # the same session run blocking
            print(f"\njob {job.id}: started on {first}, taken over by {second}, attempts {st.attempts}")
        finally:
            stop_server(proc, timeout=60)
            stop_cluster(cluster)
