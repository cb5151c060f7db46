"""A throwaway PostgreSQL server for the tests: the Debian package's ``initdb``/``pg_ctl`` in a temporary directory.

Why: the job store's replicas share one PostgreSQL (docs/jobs.md); its tests need a real one, started
and removed by the test, on a free loopback port, with nothing configured on the machine. PostgreSQL
refuses to run as root, so as root the cluster belongs to an unprivileged user (``nobody``) and its
commands run as that user. ``.ci/run`` installs the package when ``initdb`` is missing; without it the
tests that need it fail, naming what to install.
"""

from __future__ import annotations

import glob
import os
import pathlib
import pwd
import shutil
import subprocess
import tempfile

from remote_helpers import free_port

__all__ = ["PostgresServer", "pg_bin"]


def pg_bin(name: str) -> str:
    """The path of a PostgreSQL server program (``initdb``, ``pg_ctl``)."""
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)),
                                       None)
    if found is None:
        raise RuntimeError(f"PostgreSQL's {name} is not installed: `apt-get install postgresql` (.ci/run does)")
    return found


class PostgresServer:
    """``with PostgresServer() as pg: pg.url`` — a fresh cluster (trust auth on loopback), stopped and removed
    on exit."""

    def __init__(self, user: str = "nobody"):
        self.root = pathlib.Path(tempfile.mkdtemp(prefix="asyncinterp-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.as_root = os.geteuid() == 0
        self.user = user if self.as_root else pwd.getpwuid(os.geteuid()).pw_name
        self.url = f"postgresql://{self.user}@127.0.0.1:{self.port}/postgres"

    def _run(self, *args, timeout=120):
        if self.as_root:
            info = pwd.getpwnam(self.user)

            def demote():
                os.setgid(info.pw_gid)
                os.setuid(info.pw_uid)
        else:
            demote = None
        out = subprocess.run(list(args), preexec_fn=demote, capture_output=True, text=True, timeout=timeout,
                             cwd=self.root, env=dict(os.environ, LC_ALL="C.UTF-8", LANG="C.UTF-8"))
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(map(str, args))} failed ({out.returncode}): {out.stderr[-2000:]}")
        return out

    def start(self) -> "PostgresServer":
        if self.as_root:
            info = pwd.getpwnam(self.user)
            os.chown(self.root, info.pw_uid, info.pw_gid)
        self._run(pg_bin("initdb"), "-D", str(self.data), "-A", "trust", "-U", self.user, "--no-sync", "-E", "UTF8")
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=100"
        self._run(pg_bin("pg_ctl"), "-D", str(self.data), "-o", options, "-l", str(self.root / "log"), "-w",
                  "-t", "60", "start")
        return self

    def stop(self) -> None:
        try:
            if (self.data / "postmaster.pid").exists():
                self._run(pg_bin("pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop", timeout=60)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
