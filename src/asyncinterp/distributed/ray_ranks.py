"""Ranks of a tensor-parallel launch as Ray actors on different nodes: the launcher's ranks, placed by Ray.

:mod:`.launch` starts a launch's ranks as processes on this machine. Here each
rank is a Ray actor, and a placement group with the ``STRICT_SPREAD``
strategy puts every rank on a different Ray node (``"SPREAD"`` or
``"PACK"`` when one node may hold several). The ranks run the very same script
code as the launcher's: a script (or ``-m module``) with its arguments, run
as ``__main__`` in the actor, with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``/``MASTER_PORT`` (rank 0's node address and a port free
there) and ``ASYNCINTERP_TP_TIMEOUT`` set, so that
:func:`asyncinterp.distributed.init` joins a gloo group across the nodes and
``from_pretrained(path, tp_plan="auto")`` shards the model over them.
Interventions, per-invoke views and sharded views work unchanged.

::

    from asyncinterp.distributed.ray_ranks import RayRanks
    ray.init(address="auto")
    done = RayRanks(nproc=2).run(["checks.py", "out_dir"], timeout=600)
    assert done.ok, done.output(0)

Nothing waits forever: the placement group must be ready within
``placement_timeout`` seconds (else :class:`PlacementError` says what the
cluster lacks), every ``ray.get`` has a timeout, a launch that runs past its
``timeout`` is killed (``timed_out``), and a rank whose actor dies (its node
lost, the process killed) ends the wait with :class:`RanksLostError` naming
the rank and its node; the other ranks are killed with it. The model's
weights must be readable at the same path on every node (a shared file
system, or the same directory copied to each).
"""

from __future__ import annotations

import os
import runpy
import socket
import sys
import time
import traceback
import uuid
from dataclasses import dataclass, field

from ..kernel.errors import AsyncInterpError
from ..moved import old_name

__all__ = ["PlacementError", "RanksLostError", "RayLaunched", "RayRanks", "RankActor"]


def __getattr__(name):   # old names (RayJob): the compatibility table, asyncinterp.moved.RENAMED
    return old_name(__name__, name)


NAMESPACE = "asyncinterp-tp"


class RanksLostError(AsyncInterpError):
    """A rank's Ray actor died (its node was lost, or the process was killed); the launch's other ranks were stopped."""

    def __init__(self, message, ranks=(), nodes=()):
        super().__init__(message)
        self.ranks = list(ranks)       # the ranks that were lost
        self.nodes = list(nodes)       # the Ray node ids they ran on


class PlacementError(AsyncInterpError):
    """The cluster cannot place the ranks as asked (too few nodes or CPUs) within the placement timeout."""


class RankActor:
    """One rank: runs a launch's script in this Ray worker process. Made a Ray actor by :func:`_actor_class`."""

    def node(self) -> dict:
        """This rank's node: its Ray id, its address, and a TCP port free on it now."""
        import ray
        ip = ray.util.get_node_ip_address()
        ports = []
        with socket.socket() as a, socket.socket() as b:
            for s in (a, b):
                s.bind((ip, 0))
                ports.append(s.getsockname()[1])
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ip, "port": ports[0],
                "spare_port": ports[1], "pid": os.getpid()}

    def run(self, argv: list, env: dict) -> dict:
        """Run ``python *argv`` here, as ``__main__`` with ``env`` set; how it ended (never raises)."""
        os.environ.update(env)
        rank = int(env.get("RANK", 0))
        saved_argv, saved_path = list(sys.argv), list(sys.path)
        t0 = time.perf_counter()
        code, error, summary = 0, None, None
        try:
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(argv)
                sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
                runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                error = summary = str(exc.code)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller, with its traceback
            code, error = 1, "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            summary = f"{type(exc).__name__}: {exc}"
        finally:
            sys.argv, sys.path[:] = saved_argv, saved_path
            _leave_group()
        return {"rank": rank, "returncode": code, "error": error, "exception": summary,
                "seconds": round(time.perf_counter() - t0, 3)}


def _leave_group():
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort: the actor is killed after the launch anyway
        pass


_ACTOR = {}


def _actor_class():
    if "cls" not in _ACTOR:
        import ray
        _ACTOR["cls"] = ray.remote(max_restarts=0, max_task_retries=0)(RankActor)
    return _ACTOR["cls"]


@dataclass
class RayLaunched:
    """A launch's ranks on Ray (running, then finished): like the launcher's ``Launched``."""

    owner: "RayRanks"
    refs: list
    nodes: list                          # per rank: {"node_id", "ip", "port", "spare_port", "pid"}
    master: str
    results: list = field(default_factory=list)  # per rank: {"rank", "returncode", "error", "exception", "seconds"}
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return bool(self.results) and all(r and r["returncode"] == 0 for r in self.results)

    @property
    def returncodes(self) -> list:
        return [r["returncode"] if r else None for r in self.results]

    @property
    def returncode(self) -> int:
        failed = [c for c in self.returncodes if c]
        return failed[0] if failed else 0

    def output(self, rank: int = 0) -> str:
        """The error rank ``rank`` ended with (its traceback), or ``""``; its prints are in Ray's worker logs."""
        if rank >= len(self.results) or not self.results[rank]:
            return ""
        return self.results[rank]["error"] or ""

    def poll(self, timeout: float = 0.0, kill: bool = True):
        """``None`` while every rank runs; else the first rank's result to come in. Raises
        :class:`RanksLostError` when that rank's actor died (having killed the others, unless ``kill=False``:
        then the caller kills them, with :meth:`RayRanks.kill`, when the survivors had time to answer)."""
        import ray
        ready, _ = ray.wait(list(self.refs), num_returns=1, timeout=timeout)
        if not ready:
            return None
        return self._get(self.refs.index(ready[0]), ready[0], kill=kill)

    def _get(self, rank, ref, timeout=30.0, kill=True):
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, WorkerCrashedError
        try:
            return ray.get(ref, timeout=timeout)
        except (RayActorError, WorkerCrashedError) as exc:
            node = self.nodes[rank]["node_id"] if rank < len(self.nodes) else "?"
            if kill:
                self.owner.kill()
            raise RanksLostError(
                f"rank {rank} of the tensor-parallel launch was lost (its Ray actor on node {node[:12]} died: the node "
                f"left the cluster or the process was killed); the other ranks are stopped. Start the launch again "
                f"once the cluster has {self.owner.nproc} nodes for it ({type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''})", [rank], [node]) from None
        except GetTimeoutError:
            return None

    def wait(self, timeout: float | None = None, grace: float = 15.0) -> "RayLaunched":
        """Wait for every rank; kill them all at ``timeout`` s or ``grace`` s after the first failure.

        Raises :class:`RanksLostError` as soon as a rank's actor is found dead (the others are killed).
        """
        import ray
        deadline = None if timeout is None else time.monotonic() + timeout
        results = [None] * len(self.refs)
        pending = dict(enumerate(self.refs))
        failed_at = None
        try:
            while pending:
                now = time.monotonic()
                if deadline is not None and now > deadline:
                    self.timed_out = True
                    break
                if failed_at is not None and now - failed_at > grace:
                    break
                ready, _ = ray.wait(list(pending.values()), num_returns=1, timeout=0.5)
                for ref in ready:
                    rank = next(r for r, x in pending.items() if x == ref)
                    del pending[rank]
                    results[rank] = self._get(rank, ref)
                    self.owner.kill_rank(rank)   # as a launcher's rank process exits: its peers' collectives
                    #                              fail at once instead of waiting for their timeout
                    if results[rank] is None or results[rank]["returncode"]:
                        failed_at = failed_at or time.monotonic()
        finally:
            self.owner.kill()
        self.results = [r if r is not None else {"rank": i, "returncode": 124 if self.timed_out else -9,
                                                 "error": "killed: " + ("the launch ran past its timeout" if
                                                                        self.timed_out else "another rank failed"),
                                                 "seconds": None}
                        for i, r in enumerate(results)]
        return self


class RayRanks:
    """Places ``nproc`` ranks on Ray nodes and runs a launch's script on them (see the module's docstring).

    ``strategy``: the placement group's (``"STRICT_SPREAD"``: one rank per
    node); ``cpus_per_rank``: the CPUs each rank's bundle reserves;
    ``collective_timeout``: ``ASYNCINTERP_TP_TIMEOUT`` of the ranks;
    ``placement_timeout``: seconds to wait for the cluster to hold the
    placement group; ``env``: more environment for the ranks.
    Needs ``ray.init()`` (or ``address=``) first.
    """

    def __init__(self, nproc: int = 2, strategy: str = "STRICT_SPREAD", cpus_per_rank: float = 1.0,
                 collective_timeout: float = 60.0, placement_timeout: float = 60.0, env: dict | None = None,
                 address: str | None = None, name: str | None = None):
        if nproc < 1:
            raise ValueError(f"nproc must be at least 1, got {nproc}")
        self.nproc, self.strategy, self.cpus = nproc, strategy, cpus_per_rank
        self.collective_timeout, self.placement_timeout = collective_timeout, placement_timeout
        self.env = dict(env or {})
        self.address = address
        self.name = name or f"tp-{uuid.uuid4().hex[:8]}"
        self.pg = None
        self.actors = []
        self.launched = None

    # ------------------------------------------------------------------ placement
    def _connect(self):
        import ray
        if not ray.is_initialized():
            ray.init(address=self.address or "auto", namespace=NAMESPACE, log_to_driver=False,
                     logging_level="WARNING")

    def place(self) -> list:
        """Reserve one bundle per rank and start the rank actors; their nodes (rank order)."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        self._connect()
        self.kill()
        bundles = [{"CPU": self.cpus} for _ in range(self.nproc)]
        self.pg = placement_group(bundles, strategy=self.strategy, name=self.name)
        try:
            ray.get(self.pg.ready(), timeout=self.placement_timeout)
        except Exception as exc:  # noqa: BLE001 - GetTimeoutError, or the group could not be made
            remove_placement_group(self.pg)
            self.pg = None
            alive = [n for n in ray.nodes() if n.get("Alive")]
            cpus = [n.get("Resources", {}).get("CPU", 0) for n in alive]
            raise PlacementError(
                f"Ray could not place {self.nproc} ranks ({self.cpus:g} CPU each, strategy {self.strategy}) within "
                f"{self.placement_timeout:g} s: the cluster has {len(alive)} node(s) with CPUs {cpus}"
                + (f" ({self.strategy} needs {self.nproc} nodes with {self.cpus:g} free CPU each)"
                   if self.strategy == "STRICT_SPREAD" else "")
                + f". Add nodes, or use fewer ranks. ({type(exc).__name__})") from None
        cls = _actor_class()
        self.actors = [cls.options(num_cpus=self.cpus, name=f"{self.name}-rank{r}", namespace=NAMESPACE,
                                   scheduling_strategy=PlacementGroupSchedulingStrategy(
                                       placement_group=self.pg, placement_group_bundle_index=r)).remote()
                       for r in range(self.nproc)]
        try:
            return ray.get([a.node.remote() for a in self.actors], timeout=self.placement_timeout)
        except Exception:
            self.kill()
            raise

    # ------------------------------------------------------------------ jobs
    def start(self, argv: list, env=None) -> RayLaunched:
        """Start ``python *argv`` on every rank (``argv[0]`` a script, or ``["-m", "module", ...]``).

        ``env``: more environment for every rank, or a function of the ranks' nodes (a list of
        ``{"node_id", "ip", "port", "spare_port", "pid"}``) that returns it (what depends on where rank 0 landed).
        """
        if not argv:
            raise ValueError("give a script (or -m module) to run")
        nodes = self.place()
        master = nodes[0]
        env = dict(self.env, **((env(nodes) if callable(env) else env) or {}))
        if argv[0] != "-m":
            argv = [os.path.abspath(argv[0]), *argv[1:]]
        refs = []
        for r, actor in enumerate(self.actors):
            e = dict(env, RANK=str(r), WORLD_SIZE=str(self.nproc), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                     MASTER_ADDR=master["ip"], MASTER_PORT=str(master["port"]),
                     ASYNCINTERP_TP_TIMEOUT=str(self.collective_timeout))
            refs.append(actor.run.remote(list(argv), e))
        self.launched = RayLaunched(self, refs, nodes, f"{master['ip']}:{master['port']}")
        return self.launched

    def run(self, argv: list, timeout: float = 600.0, grace: float = 15.0) -> RayLaunched:
        """Run ``python *argv`` on the ranks to the end (at most ``timeout`` s); no actor is left behind."""
        return self.start(argv).wait(timeout, grace)

    def kill_rank(self, rank: int) -> None:
        """Kill one rank's actor (its process exits, as a launcher's rank does when its script ends)."""
        import ray
        if rank < len(self.actors):
            try:
                ray.kill(self.actors[rank], no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass

    def kill(self) -> None:
        """Kill the rank actors and release their placement group (idempotent)."""
        if not self.actors and self.pg is None:
            return
        import ray
        from ray.util.placement_group import remove_placement_group
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        self.actors = []
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001 - already removed (its node gone)
                pass
            self.pg = None
