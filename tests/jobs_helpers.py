"""Real ``asyncinterp serve`` subprocesses that keep jobs (docs/jobs.md), for the kept-jobs tests and benchmark.

``JobServer(state_dir, *flags)`` starts ``asyncinterp serve tiny-gpt2`` with ``--state-dir`` (or
``--database``) on a free loopback port; ``kill()`` is ``kill -9``; ``start()`` again restarts it on the
same state and port.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

from remote_helpers import free_port
from serve_helpers import wait_healthy

ROOT = pathlib.Path(__file__).resolve().parent.parent


class JobServer:
    def __init__(self, *flags, state_dir=None, database=None, model="tiny-gpt2", log=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "asyncinterp.cli", "serve", model, "--port", str(self.port),
                     "--max-wait-ms", "1", "--threads", "1", "--log-level", "warning", *flags]
        if state_dir is not None:
            self.args += ["--state-dir", str(state_dir)]
        if database is not None:
            self.args += ["--database", database]
        self.log = log
        self.proc = None
        self.starts = 0

    def start(self, timeout: float = 120) -> "JobServer":
        err = open(self.log, "a") if self.log else subprocess.PIPE
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT / "src"), MKL_CBWR="AUTO,STRICT")
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=err, text=True, env=env)
        self.starts += 1
        wait_healthy(self.proc, self.url, timeout=timeout)
        return self

    def kill(self) -> None:
        """``kill -9``: no shutdown, no cleanup."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


async def last_of_layer1(m):
    return (await m.transformer.h[1].output)[0][:, -1]


async def long_session(model):
    """A session of 400 traces (a few seconds on tiny GPT-2): long enough to be stopped while it runs."""
    total = None
    for i in range(400):
        h = await model.atrace("The Eiffel Tower is in", last_of_layer1)
        total = h if total is None else total + h
    return total
