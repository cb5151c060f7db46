"""Start an N-process launch from one command: ``python -m asyncinterp.distributed.launch --nproc 2 script.py``.

Tests, users and the server (``asyncinterp serve --tensor-parallel-size 2``)
start their ranks here instead of typing ``torchrun``. Each rank is a child
process running ``script.py`` (or ``-m module``) with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` and ``ASYNCINTERP_TP_TIMEOUT``
set, so that :func:`asyncinterp.distributed.init` joins the group.

Nothing is left behind: each rank runs in its own process session and dies
with the launcher (Linux ``PR_SET_PDEATHSIG``); when one rank fails, the
others get ``grace`` seconds to notice (their collectives fail at once when a
peer is gone) and are then killed, and the whole launch is killed after
``timeout`` seconds. The exit status is the first failed rank's (rank 0
preferred).

Python API (what the tests use)::

    from asyncinterp.distributed.launch import launch
    done = launch(["checks.py", "out.json"], nproc=2, timeout=300)
    assert done.ok, done.output(0)
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

__all__ = ["Launched", "launch", "start", "free_port", "main"]


def free_port() -> int:
    """A TCP port that is free now on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent():   # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except OSError:
        pass


def rank_env(rank: int, nproc: int, port: int, timeout: float, env=None) -> dict:
    """The environment of rank ``rank`` of an ``nproc``-process launch on this machine."""
    e = dict(os.environ if env is None else env)
    e.update({"RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
              "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
              "ASYNCINTERP_TP_TIMEOUT": str(timeout)})
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


@dataclass
class Launched:
    """A running (then finished) launch: one process per rank."""

    procs: list
    logs: list = field(default_factory=list)
    returncodes: list = field(default_factory=list)
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return bool(self.returncodes) and all(rc == 0 for rc in self.returncodes)

    @property
    def returncode(self) -> int:
        failed = [rc for rc in self.returncodes if rc]
        return failed[0] if failed else 0

    def output(self, rank: int = 0) -> str:
        """What rank ``rank`` wrote to stdout and stderr (when started with ``capture=True``)."""
        if rank >= len(self.logs) or self.logs[rank] is None:
            return ""
        self.logs[rank].seek(0)
        return self.logs[rank].read().decode("utf-8", "replace")

    def alive(self) -> list:
        return [p.pid for p in self.procs if p.poll() is None]

    def kill(self) -> None:
        """Kill every rank (and whatever it started in its session)."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    p.kill()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not fail
                pass

    def wait(self, timeout: float | None = None, grace: float = 15.0) -> "Launched":
        """Wait for every rank; kill them all at ``timeout`` or ``grace`` s after the first failure."""
        deadline = None if timeout is None else time.monotonic() + timeout
        failed_at = None
        try:
            while True:
                codes = [p.poll() for p in self.procs]
                if all(c is not None for c in codes):
                    break
                now = time.monotonic()
                if failed_at is None and any(c not in (None, 0) for c in codes):
                    failed_at = now
                if deadline is not None and now > deadline:
                    self.timed_out = True
                    break
                if failed_at is not None and now - failed_at > grace:
                    break
                time.sleep(0.05)
        finally:
            self.kill()
        # a rank killed here (timeout, or a peer's failure) reads as -9; a timeout is reported as 124
        self.returncodes = [124 if self.timed_out and p.returncode == -signal.SIGKILL else p.returncode
                            for p in self.procs]
        return self


def start(argv, nproc: int = 2, timeout: float = 60.0, capture: bool = False, env=None, port=None) -> Launched:
    """Start ``python *argv`` as ranks ``0..nproc-1`` (``argv[0]`` a script, or ``["-m", "module", ...]``).

    ``timeout``: the collective timeout of the ranks (``ASYNCINTERP_TP_TIMEOUT``).
    ``capture``: keep each rank's output (``Launched.output(rank)``) instead of sharing this terminal.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    port = port or free_port()
    procs, logs = [], []
    for r in range(nproc):
        log = tempfile.TemporaryFile() if capture else None
        procs.append(subprocess.Popen([sys.executable, *argv], env=rank_env(r, nproc, port, timeout, env),
                                      stdout=log, stderr=subprocess.STDOUT if capture else None,
                                      start_new_session=True, preexec_fn=_die_with_parent))
        logs.append(log)
    return Launched(procs, logs)


def launch(argv, nproc: int = 2, timeout: float = 600.0, collective_timeout: float = 60.0, capture: bool = True,
           env=None, grace: float = 15.0) -> Launched:
    """Run ``python *argv`` on ``nproc`` ranks to the end (at most ``timeout`` s); no process is left behind."""
    launched = start(argv, nproc, collective_timeout, capture, env)
    return launched.wait(timeout, grace)


def main(args=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m asyncinterp.distributed.launch",
        description="Run a script on N local ranks (gloo on CPU): RANK/WORLD_SIZE/MASTER_* set for each.")
    parser.add_argument("--nproc", "--nproc-per-node", type=int, default=2, help="ranks to start (default 2)")
    parser.add_argument("--timeout", type=float, default=None, help="kill the launch after this many seconds")
    parser.add_argument("--collective-timeout", type=float, default=60.0,
                        help="seconds a collective may wait for another rank (default 60)")
    parser.add_argument("-m", dest="module", default=None, help="run a module instead of a script")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="script.py and its arguments")
    ns = parser.parse_args(args)
    argv = (["-m", ns.module] if ns.module else []) + list(ns.argv)
    if not argv:
        parser.error("give a script (or -m module) to run")
    launched = start(argv, ns.nproc, ns.collective_timeout, capture=False)
    try:
        launched.wait(ns.timeout)
    except KeyboardInterrupt:
        launched.kill()
        return 130
    if launched.timed_out:
        print(f"asyncinterp.distributed.launch: the launch ran past {ns.timeout} s and was killed", file=sys.stderr)
    return launched.returncode


if __name__ == "__main__":
    sys.exit(main())
