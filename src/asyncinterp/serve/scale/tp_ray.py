"""``asyncinterp serve DIR --tensor-parallel-size N --ray-address ADDR``: a sharded model, its ranks on N Ray nodes.

Without ``--ray-address`` the ranks are processes of this machine (the
launcher, :mod:`.tp_serve`). With it, this command joins the Ray cluster and
:class:`~asyncinterp.distributed.ray_ranks.RayRanks` places one rank per
node (a placement group, ``STRICT_SPREAD``); each rank runs the launcher's
rank code unchanged (``-m asyncinterp.serve.scale.tp_serve``: rank 0 serves the
app on its node, the others follow its batches; gloo across the nodes).
The command itself serves :mod:`.tp_front` on ``--host``/``--port``: it
relays every request to rank 0 and answers ``/v1/health``.

A supervisor thread watches the ranks. When one is lost (its node leaves
the cluster, its process dies) the front reports 503 at once, the other
ranks are stopped, and the supervisor places the ranks again, retrying
until the cluster has the nodes; ``/v1/health`` is 200 again once the
model is back. A rank that fails before the model ever came up (a model
directory missing on a node, a bad option) ends the command with that
rank's error rather than retrying forever. Every wait is bounded:
placement (``--tp-placement-timeout``), start-up (``--tp-ready-timeout``),
each ``ray.get``.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time

__all__ = ["add_arguments", "run", "RankSupervisor"]

_ENV = "ASYNCINTERP_SERVE_ARGS"     # the rank code's configuration (read by tp_serve.main)
LOST_GRACE = 5.0                    # seconds rank 0 may answer its running requests after another rank was lost


def add_arguments(p) -> None:
    """The flags of ``--tensor-parallel-size N --ray-address ADDR`` (transformers engine)."""
    g = p.add_argument_group("tensor parallel on Ray nodes (docs/tensor-parallel.md)")
    g.add_argument("--tp-placement", default="STRICT_SPREAD", choices=["STRICT_SPREAD", "SPREAD", "PACK"],
                   help="with --tensor-parallel-size and --ray-address: how the ranks' placement group spreads "
                        "them (default STRICT_SPREAD: one rank per node)")
    g.add_argument("--tp-rank-cpus", type=float, default=1.0, metavar="N",
                   help="with --ray-address: Ray CPUs each rank reserves (default 1)")
    g.add_argument("--tp-placement-timeout", type=float, default=30.0, metavar="S",
                   help="with --ray-address: seconds one attempt waits for the cluster to place the ranks "
                        "(default 30; attempts repeat until it can)")
    g.add_argument("--tp-ready-timeout", type=float, default=600.0, metavar="S",
                   help="with --ray-address: seconds the ranks may take to load the model and answer (default 600)")


class RankSupervisor(threading.Thread):
    """Places the ranks, waits for rank 0's server, watches them, and places them again when one is lost."""

    def __init__(self, args, state, log, on_fatal):
        super().__init__(name="asyncinterp-tp-ranks", daemon=True)
        from ...distributed.group import configured_timeout
        from ...distributed.ray_ranks import RayRanks
        self.args, self.state, self.log, self.on_fatal = args, state, log, on_fatal
        self.stopping = threading.Event()
        self.fatal = None
        self.reached_ready = False
        self.ranks = RayRanks(nproc=args.tensor_parallel_size, strategy=args.tp_placement,
                              cpus_per_rank=args.tp_rank_cpus,
                              collective_timeout=configured_timeout(),
                              placement_timeout=args.tp_placement_timeout)
        self.payload = {k: v for k, v in vars(args).items() if k != "func"}

    def _env(self, nodes):
        lead = nodes[0]
        return {_ENV: json.dumps(dict(self.payload, host=lead["ip"], port=lead["spare_port"]))}

    def run(self) -> None:
        backoff = 1.0
        ever_ready = False
        try:
            while not self.stopping.is_set():
                outcome, detail = self._once()
                if outcome == "stopped":
                    return
                if outcome == "failed" and not ever_ready:
                    self.fatal = detail
                    self.state.set("stopped", detail)
                    self.on_fatal(detail)
                    return
                if self.reached_ready:
                    ever_ready, backoff = True, 1.0
                self.state.set("lost" if outcome in ("lost", "failed") else "waiting", detail)
                self.log.warning("tensor-parallel ranks unavailable", extra={"fields": {
                    "event": "ranks_" + outcome, "reason": detail}})
                self.stopping.wait(backoff)
                backoff = min(backoff * 2, 10.0)
        finally:
            self.ranks.kill()

    def _once(self):
        """One life of the ranks: ``(outcome, reason)``; outcome ``stopped``/``lost``/``failed``/``waiting``."""
        from ...distributed.ray_ranks import PlacementError, RanksLostError
        self.reached_ready = False
        self.state.set("starting", f"placing {self.ranks.nproc} ranks ({self.ranks.strategy})")
        try:
            job = self.ranks.start(["-m", "asyncinterp.serve.scale.tp_serve"], env=self._env)
        except PlacementError as exc:
            return "waiting", str(exc)
        except Exception as exc:  # noqa: BLE001 - the cluster itself failed under us: report and retry
            return "waiting", f"could not start the ranks on Ray: {type(exc).__name__}: {exc}"
        lead = job.nodes[0]
        upstream = f"http://{lead['ip']}:{lead['spare_port']}"
        where = ", ".join(f"rank {r} on node {n['node_id'][:12]} ({n['ip']})" for r, n in enumerate(job.nodes))
        self.state.set("starting", f"the ranks are loading the model ({where})", nodes=job.nodes)
        try:
            ready = self._until_ready(job, upstream)
            if ready is not None:
                return ready
            self.reached_ready = True
            self.state.set("ready", "", upstream=upstream, nodes=job.nodes)
            self.log.info("tensor-parallel ranks ready", extra={"fields": {
                "event": "ranks_ready", "ranks": [n["node_id"] for n in job.nodes], "upstream": upstream}})
            while not self.stopping.is_set():
                ended = job.poll(timeout=0.5, kill=False)
                if ended is not None:
                    return "failed", _ended(ended)
            return "stopped", "stopped"
        except RanksLostError as exc:
            lost = ", ".join(f"rank {r} on node {n[:12]}" for r, n in zip(exc.ranks, exc.nodes))
            reason = (f"{lost} was lost (its node left the Ray cluster or its process died); the other ranks are "
                      "stopped")
            # unavailable at once; the survivors' collectives fail at once, so they answer what they were running
            self.state.set("lost", reason)
            self.stopping.wait(LOST_GRACE)
            return "lost", reason
        finally:
            self.ranks.kill()

    def _until_ready(self, job, upstream):
        import httpx
        deadline = time.monotonic() + self.args.tp_ready_timeout
        while not self.stopping.is_set():
            ended = job.poll(timeout=0.5)
            if ended is not None:
                return "failed", _ended(ended)
            try:
                if httpx.get(upstream + "/v1/health", timeout=2.0).status_code == 200:
                    return None
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                return "lost", (f"the ranks did not answer within --tp-ready-timeout "
                                f"{self.args.tp_ready_timeout:g} s (loading the model, or stuck)")
        return "stopped", "stopped"

    def stop(self, timeout: float = 30.0) -> None:
        self.stopping.set()
        self.join(timeout)
        self.ranks.kill()


def _ended(result: dict) -> str:
    what = (result.get("exception") or "").strip() or f"exit status {result.get('returncode')}"
    return f"rank {result.get('rank')} of the tensor-parallel model stopped: {what[:1500]}"


def _unreachable(address: str, timeout: float = 5.0) -> str:
    """Why ``HOST:PORT`` takes no TCP connection within ``timeout`` s ("" when it does, or for 'auto'/'ray://'):
    Ray's own client retries a wrong address for minutes before it gives up."""
    import socket
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return ""
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return ""
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def run(args) -> int:
    """Serve ``args.model`` with its ranks on Ray nodes until Ctrl-C; the front on ``--host``/``--port``."""
    from ..http.startup import setup_logging
    setup_logging(args.log_format, args.log_level)
    log = logging.getLogger("asyncinterp.serve")
    try:
        import ray
    except ImportError as exc:
        print(f"asyncinterp serve: --ray-address needs Ray (pip install 'asyncinterp[ray]'): {exc}", file=sys.stderr)
        return 1
    if args.tp_rank_cpus <= 0 or args.tp_placement_timeout <= 0 or args.tp_ready_timeout <= 0:
        print("asyncinterp serve: --tp-rank-cpus, --tp-placement-timeout and --tp-ready-timeout must be positive",
              file=sys.stderr)
        return 2
    import uvicorn

    from ...distributed.ray_ranks import NAMESPACE
    from .tp_front import RankState, front_app
    unreachable = _unreachable(args.ray_address)
    if unreachable:
        print(f"asyncinterp serve: no Ray cluster answers at {args.ray_address!r} ({unreachable}); start it with "
              "`ray start --head` and pass its address (HOST:PORT, or 'auto')", file=sys.stderr)
        return 1
    try:
        ray.init(address=args.ray_address, namespace=NAMESPACE, logging_level=logging.WARNING, log_to_driver=False)
    except Exception as exc:  # noqa: BLE001 - a wrong address, no cluster there: one clear line
        print(f"asyncinterp serve: could not join the Ray cluster at {args.ray_address!r} ({type(exc).__name__}: "
              f"{exc}); start it with `ray start --head` and pass its address (HOST:PORT, or 'auto')",
              file=sys.stderr)
        return 1
    state = RankState(args.tensor_parallel_size)
    name = args.served_model_name or args.model
    userver = uvicorn.Server(uvicorn.Config(front_app(state, name, args.timeout), host=args.host, port=args.port,
                                            log_level="warning", access_log=False))

    def on_fatal(reason):
        log.error("tensor-parallel ranks failed", extra={"fields": {"event": "ranks_failed", "reason": reason}})
        userver.should_exit = True

    supervisor = RankSupervisor(args, state, log, on_fatal)
    supervisor.start()
    log.info("serving", extra={"fields": {"event": "startup", "model": name, "engine": "transformers",
                                          "tensor_parallel_size": args.tensor_parallel_size, "ray": args.ray_address,
                                          "placement": args.tp_placement, "host": args.host, "port": args.port}})
    try:
        userver.run()
    finally:
        supervisor.stop()
        ray.shutdown()
    if supervisor.fatal:
        print(f"asyncinterp serve: {supervisor.fatal}", file=sys.stderr)
        return 1
    return 0
