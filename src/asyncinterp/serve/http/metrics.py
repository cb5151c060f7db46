"""``GET /metrics``: the server's counters in Prometheus' text format (``prometheus_client``), plus vLLM's own.

Why this module exists: operators scrape vLLM's server at ``/metrics``; a
drop-in must answer there too, with what this server adds: requests by
endpoint and status, sandbox refusals, budget cuts (requests stopped at
their time limit or compute budget), the queue depth and worker restarts.
Each :class:`ServerMetrics` has its own ``CollectorRegistry``, so several
servers in one process (tests, notebooks) never share or collide on a
counter. On a vLLM engine, vLLM's own families (``vllm:*``: the names of
vLLM's ``PrometheusStatLogger``, so dashboards built for vLLM's server work
unchanged) are added from the registry vLLM records into, while this
server's engine records statistics: ``asyncinterp serve --engine vllm`` has
them on, as ``vllm serve`` does, unless ``--disable-log-stats`` is given;
an ``ai.VLLM`` built in Python follows ``vllm.LLM``'s default (off) unless
given ``disable_log_stats=False``. vLLM keeps its families in the process's
global registry after an engine closes; they are shown only while the
engine this server holds records, never a previous engine's leftovers.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "asyncinterp_"


class _Live:
    """A collector of values read at scrape time: the batcher's queue depth and its worker restarts."""

    def __init__(self, batcher):
        self.batcher = batcher

    def collect(self):
        queue = GaugeMetricFamily(PREFIX + "queue_depth", "Requests waiting for the model (or in the engine, "
                                                          "for a live engine such as vLLM)")
        queue.add_metric([], float(self.batcher.queue_size()))
        yield queue
        restarts = CounterMetricFamily(PREFIX + "worker_restarts", "Worker processes restarted after they hung, "
                                                                   "crashed or ran out of memory (process isolation)")
        restarts.add_metric([], float(self.batcher.stats.get("restarts", 0)))
        yield restarts


class _VLLMFamilies:
    """vLLM's own metric families (``vllm:*``) from the registry its stat loggers record into, while ``engine``
    (vLLM's ``LLMEngine``) records statistics."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        if not getattr(self.engine, "log_stats", False):
            return
        try:
            from vllm.v1.metrics.prometheus import get_prometheus_registry
        except Exception:  # noqa: BLE001 - vLLM not importable: nothing of its to show
            return
        for family in get_prometheus_registry().collect():
            if family.name.startswith("vllm:"):
                yield family


class ServerMetrics:
    """The counters of one server, in a registry of its own; ``render()`` is the ``/metrics`` body."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, batcher, vllm=None):
        """``vllm``: the vLLM ``LLMEngine`` this server serves from, whose statistics ``/metrics`` shows."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(PREFIX + "requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.refusals = Counter(PREFIX + "sandbox_refusals", "Submitted code the sandbox refused (or the server "
                                "does not accept code at all)", registry=self.registry)
        self.budget_cuts = Counter(PREFIX + "budget_cuts", "Requests stopped at their time limit or their "
                                   "submitted code's compute budget", registry=self.registry)
        self.registry.register(_Live(batcher))
        if vllm is not None:
            self.registry.register(_VLLMFamilies(vllm))

    def answered(self, endpoint: str, status: int, kind: str | None = None) -> None:
        """Count one answered request; ``kind``: its error's kind (:data:`.errors.KINDS`), if it failed."""
        self.requests.labels(endpoint, str(status)).inc()
        self.failed(kind)

    def failed(self, kind: str | None) -> None:
        """Count a failure of ``kind`` where it is one of the counted ones (refusals, budget cuts)."""
        if kind == "refused":
            self.refusals.inc()
        elif kind == "timeout":
            self.budget_cuts.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
