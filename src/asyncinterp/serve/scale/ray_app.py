"""The Ray Serve application: N replicas of the HTTP server, each with its own engine, behind Ray's proxy.

Why it exists: one ``asyncinterp serve`` process holds one engine, and a
user with more traffic than one engine can take needs more of them behind
one address. Ray Serve already has what that takes (a proxy, a router that
spreads requests over replicas, health checks, restarts, autoscaling), so
each replica here is the unchanged Starlette app of :mod:`.app`, wrapped
with ``serve.ingress``, built from the same command line as ``asyncinterp
serve`` (:func:`.startup.make_server`): the native and OpenAI endpoints,
streaming, API keys, the sandbox and process isolation behave as on one
server, because they are the same code.

Two ways in:

* ``asyncinterp serve MODEL ... --replicas N [--ray-address ADDR]``
  (:mod:`.replicas`, the command-line side);
* this module's application builder, for Ray Serve's own tools and config
  files (where autoscaling is set, see docs/scale-out.md)::

      serve run asyncinterp.serve.scale.ray_app:build argv="tiny-gpt2 --api-key secret"

Each replica's answers carry an ``x-asyncinterp-replica`` header (Ray
Serve's id of the replica that answered). This module imports Ray at the
top: it is imported only when replicas are asked for, never by ``import
asyncinterp``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex

from ray import serve

from ..http import startup

APP_NAME = "asyncinterp"
DEPLOYMENT_NAME = "AsyncinterpServer"
REPLICA_HEADER = b"x-asyncinterp-replica"

# command-line fields that describe the deployment (or this driver), not one replica's server
DRIVER_ONLY = frozenset({"func", "command", "replicas", "ray_address", "replica_cpus", "max_ongoing_requests",
                         "max_replicas_per_node", "proxy_location", "object_store_mb", "ray_app_name"})

log = logging.getLogger("asyncinterp.serve")


# --------------------------------------------------------------------------- one replica
@serve.deployment(name=DEPLOYMENT_NAME, health_check_period_s=5.0, health_check_timeout_s=30.0,
                  graceful_shutdown_timeout_s=20.0)
@serve.ingress()
class ServerReplica:
    """One replica: the model and the :class:`~.app.Server` that ``asyncinterp serve`` would build from
    ``options`` (the command line's fields as a plain JSON-able map, API keys already resolved)."""

    def __init__(self, options: dict):
        args = argparse.Namespace(**options)
        startup.prepare_process(args)
        self.model = startup.build_model(args)
        try:
            self.server = startup.make_server(args, self.model, list(args.api_key), log)
        except BaseException:
            _close_model(self.model)
            raise
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id if context is not None else f"pid{os.getpid()}"
        log.info("replica ready", extra={"fields": {"event": "startup", "replica": self.replica_id,
                                                    "model": self.server.name, "engine": self.server.front.kind,
                                                    "pid": os.getpid()}})

    def __serve_build_asgi_app__(self):
        return TaggedApp(self.server.app, self.replica_id)

    def check_health(self):
        """Ray Serve's health check (every ``health_check_period_s``): failing it makes Ray replace the replica.
        A supervised server restarts its own workers; what only a new replica can fix is a closed batcher."""
        if getattr(self.server.batcher, "closed", False):
            raise RuntimeError(f"replica {self.replica_id}: the server's batcher is closed")

    def __del__(self):
        # the app's own shutdown (its lifespan) closed the batcher; a vLLM engine and its workers stop here
        _close_model(getattr(self, "model", None))


def _close_model(model) -> None:
    close = getattr(model, "close", None)
    if close is not None:
        close()


class TaggedApp:
    """The server's ASGI app, with the ``x-asyncinterp-replica`` header on every answer."""

    def __init__(self, app, replica_id: str):
        self.app = app
        self.tag = replica_id.encode()

    def add_exception_handler(self, exc_class, handler) -> None:
        # Ray Serve maps its own back-pressure errors to 503 through the app's exception handlers
        self.app.add_exception_handler(exc_class, handler)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def tagged(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=list(message.get("headers", [])) + [(REPLICA_HEADER, self.tag)])
            await send(message)
        return await self.app(scope, receive, tagged)


# --------------------------------------------------------------------------- the application
def replica_options(args: argparse.Namespace) -> dict:
    """What each replica needs from the parsed command line: a plain map (it travels through Ray's control
    plane), with the API keys resolved here (``--api-key`` and ``$ASYNCINTERP_API_KEYS``) and local paths made
    absolute."""
    options = {k: v for k, v in vars(args).items() if k not in DRIVER_ONLY}
    options["api_key"] = startup.api_keys(args)
    options["interventions"] = [os.path.abspath(p) for p in options.get("interventions") or []]
    if isinstance(options.get("model"), str) and os.path.isdir(options["model"]):
        options["model"] = os.path.abspath(options["model"])
    try:
        json.dumps(options)
    except TypeError as exc:
        raise ValueError(f"the replicas' options must be plain values: {exc}") from None
    return options


def deployment_options(args: argparse.Namespace) -> dict:
    """Ray Serve's options for the deployment, from the command line (a Serve config file overrides them)."""
    out = {"ray_actor_options": {"num_cpus": float(getattr(args, "replica_cpus", None) or 1.0)}}
    if getattr(args, "replicas", None) is not None:
        out["num_replicas"] = int(args.replicas)
    ongoing = getattr(args, "max_ongoing_requests", None)
    # the server coalesces concurrent requests into batches: let a replica hold two batches' worth at once
    out["max_ongoing_requests"] = int(ongoing) if ongoing else 2 * int(args.max_batch)
    if getattr(args, "max_replicas_per_node", None):
        out["max_replicas_per_node"] = int(args.max_replicas_per_node)
    return out


def application(args: argparse.Namespace):
    """The Ray Serve application for parsed ``asyncinterp serve`` arguments (``--replicas`` etc. included)."""
    return ServerReplica.options(**deployment_options(args)).bind(replica_options(args))


def parse_argv(argv) -> argparse.Namespace:
    """``asyncinterp serve`` arguments (a list, or one string split as a shell would) as parsed fields."""
    if isinstance(argv, str):
        argv = shlex.split(argv)
    if not isinstance(argv, (list, tuple)) or not all(isinstance(a, str) for a in argv):
        raise ValueError("argv must be the `asyncinterp serve` arguments: a string or a list of strings")
    parser = argparse.ArgumentParser(prog="asyncinterp.serve.scale.ray_app:build", add_help=False)
    startup.configure(parser)
    try:
        return parser.parse_args(list(argv))
    except SystemExit:
        raise ValueError(f"argv: not valid `asyncinterp serve` arguments: {list(argv)!r}") from None


def build(args: dict):
    """Ray Serve application builder (``import_path: asyncinterp.serve.scale.ray_app:build``).

    ``args``: ``{"argv": "MODEL --api-key KEY ..."}``, the ``asyncinterp
    serve`` arguments each replica is built from (a string or a list; the
    server's flags, not ``--replicas`` and its group). Replica counts,
    autoscaling, ``max_ongoing_requests`` and ``ray_actor_options`` come from
    Ray Serve's config (the ``deployments`` entry named
    ``AsyncinterpServer``; without one: 1 replica, 1 CPU,
    ``max_ongoing_requests`` 2 x ``--max-batch``).
    """
    args = dict(args or {})
    unknown = sorted(set(args) - {"argv"})
    if unknown:
        raise ValueError(f"unknown application argument(s) {unknown}: give the server's command line as "
                         "argv, e.g. {'argv': 'tiny-gpt2 --api-key secret'}")
    return application(parse_argv(args.get("argv", [])))
