"""A worker's own Prometheus metrics (``flotilla_worker_*``), for ``--metrics-port``.

Read when scraped, from what the worker already keeps: its engine's load reports (the ``WorkerLoad``
per dp rank it publishes for routers every second, runtime/kv/load_metrics.py), its request server's
counters (runtime/request_plane/server.py) and its KV event publisher's (runtime/kv/publisher.py).
Nothing is counted twice and the request path pays nothing. A rank's numbers an engine does not
report (a non-KV engine knows only its active requests) are left out rather than shown as 0.

* ``flotilla_worker_running_requests`` / ``_waiting_requests`` / ``_active_requests``: the engine's
  queues per dp rank; a waiting queue that grows means the worker is past what it can take.
* ``flotilla_worker_kv_usage_ratio``, ``_kv_active_blocks``, ``_kv_total_blocks``: its KV cache.
* ``flotilla_worker_preemptions_total``: running requests the engine evicted to make room (their
  blocks are recomputed); a steady rate means the cache is too small for the load sent here.
* ``flotilla_worker_generated_tokens_total``: output tokens, whose rate is the worker's throughput.
* ``flotilla_worker_prefills_total`` / ``_prefill_seconds_total`` and ``flotilla_worker_kv_handoffs_total`` /
  ``_kv_handoff_first_token_seconds_total``: in disaggregated serving, the prompts it computed for decode
  workers and the handoffs it took, and their summed seconds (rate over rate: the mean of each).
* ``flotilla_worker_kv_event_batches_published_total`` / ``_lost_total``: KV event batches sent to
  routers, and those NATS would not take (routers see a gap and ask for the whole cache).
* ``flotilla_worker_ack_deadline_expiries_total``: streams stopped because their client stopped
  acknowledging (``FLOTILLA_STREAM_ACK_DEADLINE_S``: the ingress died or was cut off).
* ``flotilla_worker_busy_refusals_total``: requests refused because the worker's own queue was full
  (``FLOTILLA_MAX_WAITING_REQUESTS``).

After them come the engine's own metrics, where it keeps some (``EngineMetricsSource``: vLLM's ``vllm:*``, as
its own OpenAI server's /metrics shows them, with the Python process's), so one scrape of the worker has both.
"""

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from runtime.engine import EngineMetricsSource
from runtime.kv.load_metrics import LoadReports
from runtime.kv.publisher import KvEventPublisher
from runtime.request_plane import EndpointServer

if TYPE_CHECKING:
    from runtime.endpoint import Endpoint

_PREFIX = "flotilla_worker"


class WorkerMetrics(Collector):
    """The metrics of one served endpoint, read at each scrape; ``exposition()`` is the /metrics body."""

    def __init__(
        self,
        *,
        server: EndpointServer,
        load: LoadReports,
        publisher: KvEventPublisher | None = None,
        engine: EngineMetricsSource | None = None,
    ) -> None:
        self._server = server
        self._load = load
        self._publisher = publisher
        self._engine = engine
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    @classmethod
    def of(cls, endpoint: "Endpoint", engine: object = None) -> "WorkerMetrics":
        """The metrics of ``endpoint``, which serves already, and of ``engine`` where it keeps its own. Raises
        RuntimeError if the endpoint does not serve."""
        if endpoint.server is None or endpoint.load_reports is None:
            raise RuntimeError(f"{endpoint.address} is not served yet: call serve_bytes() first")
        source = engine if isinstance(engine, EngineMetricsSource) else None
        return cls(server=endpoint.server, load=endpoint.load_reports, publisher=endpoint.kv_publisher, engine=source)

    def exposition(self) -> bytes:
        own = generate_latest(self.registry)
        registry = self._engine.prometheus_registry() if self._engine is not None else None
        return own if registry is None else own + generate_latest(registry)

    def collect(self) -> Iterator[Metric]:
        gauges = {
            "running": GaugeMetricFamily(
                f"{_PREFIX}_running_requests", "Requests the engine is running, per dp rank.", labels=["dp_rank"]
            ),
            "waiting": GaugeMetricFamily(
                f"{_PREFIX}_waiting_requests",
                "Requests waiting for the engine (not scheduled yet, or preempted), per dp rank.",
                labels=["dp_rank"],
            ),
            "active_requests": GaugeMetricFamily(
                f"{_PREFIX}_active_requests",
                "Requests the engine holds, running plus waiting, per dp rank.",
                labels=["dp_rank"],
            ),
            "kv_usage": GaugeMetricFamily(
                f"{_PREFIX}_kv_usage_ratio",
                "Share (0..1) of the KV cache's blocks in use, per dp rank.",
                labels=["dp_rank"],
            ),
            "kv_active_blocks": GaugeMetricFamily(
                f"{_PREFIX}_kv_active_blocks", "KV blocks held by running requests, per dp rank.", labels=["dp_rank"]
            ),
            "kv_total_blocks": GaugeMetricFamily(
                f"{_PREFIX}_kv_total_blocks", "KV blocks in the cache, per dp rank.", labels=["dp_rank"]
            ),
        }
        counters = {
            "preemptions": CounterMetricFamily(
                f"{_PREFIX}_preemptions",
                "Running requests the engine evicted to free KV blocks (recomputed later), per dp rank.",
                labels=["dp_rank"],
            ),
            "generated_tokens": CounterMetricFamily(
                f"{_PREFIX}_generated_tokens", "Output tokens the engine produced, per dp rank.", labels=["dp_rank"]
            ),
            "prefills": CounterMetricFamily(
                f"{_PREFIX}_prefills",
                "Prompts computed for a decode worker (disaggregated serving; on dp rank 0).",
                labels=["dp_rank"],
            ),
            "prefill_seconds": CounterMetricFamily(
                f"{_PREFIX}_prefill_seconds", "Their seconds from arrival to KV handoff, summed.", labels=["dp_rank"]
            ),
            "handoffs": CounterMetricFamily(
                f"{_PREFIX}_kv_handoffs",
                "Requests taken with a prefill worker's KV handoff (disaggregated serving; on dp rank 0).",
                labels=["dp_rank"],
            ),
            "handoff_first_token_seconds": CounterMetricFamily(
                f"{_PREFIX}_kv_handoff_first_token_seconds",
                "Their seconds from arrival to first token, summed.",
                labels=["dp_rank"],
            ),
        }
        for report in self._load():
            rank = [str(report.dp_rank)]
            for field, family in gauges.items():
                value = getattr(report, field)
                if value is not None:
                    family.add_metric(rank, value)
            for field, counter in counters.items():
                value = getattr(report, field)
                if value is not None:
                    counter.add_metric(rank, value)
        yield from gauges.values()
        yield from counters.values()
        server = self._server
        yield GaugeMetricFamily(
            f"{_PREFIX}_streams",
            "Requests in flight on the request plane (being answered).",
            value=server.active_requests,
        )
        yield CounterMetricFamily(
            f"{_PREFIX}_ack_deadline_expiries",
            "Streams stopped, their engine request aborted, because their client stopped acknowledging frames "
            "for the ack deadline (its ingress died or was cut off).",
            value=server.abandoned,
        )
        yield CounterMetricFamily(
            f"{_PREFIX}_busy_refusals",
            "Requests refused because the worker's own queue was full (FLOTILLA_MAX_WAITING_REQUESTS).",
            value=server.refused_busy,
        )
        publisher = self._publisher
        if publisher is not None:
            yield CounterMetricFamily(
                f"{_PREFIX}_kv_event_batches_published",
                "KV event batches published for the routers.",
                value=publisher.batches_published,
            )
            yield CounterMetricFamily(
                f"{_PREFIX}_kv_event_batches_lost",
                "KV event batches NATS did not take (routers see a gap and ask for the whole cache).",
                value=publisher.batches_lost,
            )
