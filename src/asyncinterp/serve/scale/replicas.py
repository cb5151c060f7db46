"""``asyncinterp serve ... --replicas N``: N copies of the server behind Ray Serve, from the command line.

Why it exists: the command-line side of replicated serving. It adds the
``--replicas`` flags to ``asyncinterp serve``, starts a local Ray cluster
(small: no dashboard, a small object store) or joins one
(``--ray-address``), deploys the application of :mod:`.ray_app` with Ray
Serve's proxy on ``--host``/``--port``, and on Ctrl-C takes it down again.
Ray is imported only here and in :mod:`.ray_app`, when replicas are asked
for. See docs/scale-out.md.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time

LOCAL_OBJECT_STORE_MB = 128      # a local cluster's object store: requests and answers never go through it


def add_arguments(p) -> None:
    """The replica flags of ``asyncinterp serve`` (used only with ``--replicas``)."""
    g = p.add_argument_group("replicas on Ray Serve (docs/scale-out.md)")
    g.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="serve N replicas of this server, each with its own engine, behind Ray Serve's proxy "
                        "and router (needs the `ray` extra)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="with --replicas: join this Ray cluster ('auto', HOST:PORT); default: start a local one. "
                        "With --tensor-parallel-size N (transformers): run the N ranks on N nodes of this cluster")
    g.add_argument("--replica-cpus", type=float, default=1.0, metavar="N",
                   help="with --replicas: Ray CPUs each replica reserves (default 1)")
    g.add_argument("--max-ongoing-requests", type=int, default=None, metavar="N",
                   help="with --replicas: requests Ray Serve sends one replica at once (default 2 x --max-batch)")
    g.add_argument("--max-replicas-per-node", type=int, default=None, metavar="N",
                   help="with --replicas: at most N replicas on one Ray node (1 spreads them over nodes)")
    g.add_argument("--proxy-location", choices=["HeadOnly", "EveryNode"], default="HeadOnly",
                   help="with --replicas: Ray Serve's HTTP proxy on the head node only (default) or on every node")
    g.add_argument("--object-store-mb", type=int, default=LOCAL_OBJECT_STORE_MB, metavar="MB",
                   help=f"with --replicas and no --ray-address: the local cluster's object store "
                        f"(default {LOCAL_OBJECT_STORE_MB})")
    g.add_argument("--ray-app-name", default=None, metavar="NAME",
                   help="with --replicas: the Ray Serve application's name (default asyncinterp)")
    from .tp_ray import add_arguments as tp_ray_arguments
    tp_ray_arguments(p)


def run(args) -> int:
    """N replicas on Ray Serve (``args.replicas`` set): the command's choice is made in :mod:`asyncinterp.serve.cli`."""
    from ..http.reach import is_loopback
    if getattr(args, "replicas", None) is None:
        raise ValueError("asyncinterp.serve.scale.replicas.run serves --replicas N; `asyncinterp serve` (or "
                         "asyncinterp.serve.cli.run) chooses between replicas, ranks and one server")
    if not is_loopback(args.host) and not args.allow_non_loopback:
        print(f"asyncinterp serve: refusing to bind {args.host!r}: only loopback addresses (127.0.0.1, ::1, "
              "localhost) unless --allow-non-loopback", file=sys.stderr)
        return 2
    try:
        return run_replicated(args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"asyncinterp serve: error: {exc}", file=sys.stderr)
        return 1


def main(argv=None) -> int:
    """``python -m asyncinterp.serve.scale.replicas MODEL --replicas N ...``: replicated ``asyncinterp serve``."""
    import argparse
    from ..http.startup import configure
    p = argparse.ArgumentParser(prog="asyncinterp serve", description=__doc__.split("\n\n")[0])
    configure(p)
    add_arguments(p)
    try:
        return run(p.parse_args(argv))
    except KeyboardInterrupt:
        return 130


def check(args) -> None:
    """Refuse inconsistent replica flags before anything starts."""
    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    if args.replica_cpus <= 0:
        raise ValueError(f"--replica-cpus must be positive, got {args.replica_cpus}")
    if args.engine == "transformers" and (args.tensor_parallel_size or 1) > 1:
        raise ValueError("--replicas with --tensor-parallel-size is not supported on the transformers engine: serve "
                         "one sharded model with --tensor-parallel-size N --ray-address ADDR (its ranks on N Ray "
                         "nodes, docs/tensor-parallel.md), without --replicas")
    if args.max_ongoing_requests is not None and args.max_ongoing_requests < 1:
        raise ValueError(f"--max-ongoing-requests must be at least 1, got {args.max_ongoing_requests}")
    if args.max_replicas_per_node is not None and args.max_replicas_per_node < 1:
        raise ValueError(f"--max-replicas-per-node must be at least 1, got {args.max_replicas_per_node}")
    if args.port == 0:
        raise ValueError("--port 0 is not supported with --replicas: Ray Serve's proxy needs a fixed port")


def start_ray(address: str | None, *, num_cpus: float, object_store_mb: int) -> bool:
    """Join the cluster at ``address``, or start a small local one; True when it started one."""
    import os
    import ray
    from .replica_loss import PROXY_CALLBACK, PROXY_CALLBACK_ENV
    if address:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
        return False
    # the local cluster's processes (Ray Serve's proxy among them) inherit this: a replica lost under a
    # request is answered with a clear 502 (see .replica_loss)
    os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
    ray.init(address="local", num_cpus=max(1, int(round(num_cpus))), object_store_memory=object_store_mb << 20,
             include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True)
    return True


def run_replicated(args) -> int:
    """Serve ``args`` (the ``asyncinterp serve`` command line) as ``--replicas`` replicas until Ctrl-C."""
    from ..http.startup import engine_options, setup_logging
    check(args)
    engine_options(args)     # refuse inconsistent engine options before starting anything
    setup_logging(args.log_format, args.log_level)
    log = logging.getLogger("asyncinterp.serve")
    try:
        from . import ray_app
    except ImportError as exc:
        print(f"asyncinterp serve: --replicas needs Ray Serve (pip install 'asyncinterp[ray]'): {exc}",
              file=sys.stderr)
        return 1
    import ray
    from ray import serve
    name = args.ray_app_name or ray_app.APP_NAME
    app = ray_app.application(args)          # checks the options before the cluster starts
    local = start_ray(args.ray_address, num_cpus=args.replicas * args.replica_cpus,
                      object_store_mb=args.object_store_mb)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": args.host, "port": args.port}, proxy_location=args.proxy_location)
        serve.run(app, name=name, route_prefix="/", blocking=False)
        log.info("serving", extra={"fields": {"event": "startup", "replicas": args.replicas, "app": name,
                                              "host": args.host, "port": args.port,
                                              "ray": args.ray_address or "local", "model": args.model}})
        while not stop.wait(0.5):
            pass
        return 0
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _take_down(name, local, log)


def _take_down(name: str, local: bool, log) -> None:
    """Delete the application (its replicas stop); a local cluster is shut down with it."""
    import ray
    from ray import serve
    t0 = time.monotonic()
    try:
        if local:
            serve.shutdown()
        else:
            serve.delete(name)
    except Exception as exc:  # noqa: BLE001 - report, and still leave the cluster
        log.warning("could not take the application down: %s", exc, extra={"fields": {"event": "shutdown"}})
    finally:
        ray.shutdown()
    log.info("stopped", extra={"fields": {"event": "shutdown", "app": name,
                                          "seconds": round(time.monotonic() - t0, 2)}})


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
