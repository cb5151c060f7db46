"""The command line of kept jobs: ``--state-dir``, ``--database``, ``--admin-key``, ``--job-*``, ``--quota-*``.

Why here: ``asyncinterp serve`` (and each Ray Serve replica, built from the same command line) adds these
flags with :func:`add_arguments` and turns kept jobs on with :func:`attach`; nothing of the job store is
imported unless one of ``--state-dir`` / ``--database`` is given.
"""

from __future__ import annotations

import argparse
import os

__all__ = ["add_arguments", "attach", "config_of"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("kept jobs (submitted with wait=false; docs/jobs.md)")
    g.add_argument("--state-dir", default=None, metavar="DIR",
                   help="keep jobs in a SQLite store under DIR (results beside it); they survive restarts")
    g.add_argument("--database", default=None, metavar="URL",
                   help="keep jobs in PostgreSQL (postgresql://USER@HOST:PORT/DB), shared by replicas; "
                        "also $ASYNCINTERP_DATABASE")
    g.add_argument("--admin-key", action="append", default=[], metavar="KEY",
                   help="an API key that lists (and may cancel) every key's jobs (repeatable); also "
                        "$ASYNCINTERP_ADMIN_KEYS (comma separated)")
    g.add_argument("--job-lease", type=float, default=15.0, metavar="S",
                   help="seconds a server holds a running job without renewing its lease; a job whose server "
                        "died runs again after it (default 15)")
    g.add_argument("--job-max-attempts", type=int, default=3, metavar="N",
                   help="runs a job may start: one whose server died N times while running it fails instead of "
                        "running again (default 3)")
    g.add_argument("--job-concurrency", type=int, default=8, metavar="N", help="kept jobs run at once (default 8)")
    g.add_argument("--job-ttl", type=float, default=7 * 86400.0, metavar="S",
                   help="seconds a finished job's result is kept (default 7 days)")
    g.add_argument("--file-ttl", type=float, default=30 * 86400.0, metavar="S",
                   help="seconds an uploaded file (and a batch's output) is kept unless its upload names "
                        "expires_after (default 30 days, OpenAI's)")
    g.add_argument("--job-timeout", type=float, default=None, metavar="S",
                   help="time limit of one kept job (default: --timeout)")
    g.add_argument("--quota-queued", type=int, default=100, metavar="N", help="queued jobs per key (default 100)")
    g.add_argument("--quota-running", type=int, default=4, metavar="N", help="running jobs per key (default 4)")
    g.add_argument("--quota-compute-seconds", type=float, default=None, metavar="S",
                   help="seconds of running jobs per key per hour (default: no limit)")
    g.add_argument("--quota-result-bytes", type=int, default=1 << 30, metavar="N",
                   help="bytes of kept results per key (default 1 GiB)")


def _admin_keys(args) -> list:
    return list(getattr(args, "admin_key", None) or []) + [
        k.strip() for k in os.environ.get("ASYNCINTERP_ADMIN_KEYS", "").split(",") if k.strip()]


def config_of(args):
    """The :class:`~.service.DurableConfig` of the command line, or ``None`` when jobs are not kept."""
    database = getattr(args, "database", None) or os.environ.get("ASYNCINTERP_DATABASE") or None
    state_dir = getattr(args, "state_dir", None)
    if not database and not state_dir:
        return None
    from .quotas import Quotas
    from .service import DurableConfig
    return DurableConfig(state_dir=state_dir, database=database, admin_keys=tuple(_admin_keys(args)),
                         lease=args.job_lease, max_attempts=args.job_max_attempts, concurrency=args.job_concurrency, ttl=args.job_ttl,
                         file_ttl=args.file_ttl,
                         job_timeout=args.job_timeout,
                         quotas=Quotas(queued=args.quota_queued, running=args.quota_running,
                                       compute_seconds_per_hour=args.quota_compute_seconds,
                                       result_bytes=args.quota_result_bytes))


def attach(server, args) -> None:
    """Turn kept jobs on for ``server`` when the command line asks (before its app is built)."""
    config = config_of(args)
    if config is None:
        return
    from .service import Durable
    if config.admin_keys:
        if not server.api_keys:
            raise ValueError("--admin-key needs --api-key too (a server without keys has no owners to tell apart)")
        server.api_keys += [k.encode() for k in config.admin_keys]
    server.durable = Durable(server, config)
