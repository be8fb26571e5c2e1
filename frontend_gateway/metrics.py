"""Prometheus metrics of the gateway, named in the style of Dynamo's frontend and vLLM.

The collectors live in a registry owned by the app (no module globals), and labelled children are
cached per model so that the per-token path does one dict lookup, not a label resolution. The routing
metrics (``flotilla_router_*``: the KV router's health and choices, busy refusals, migrations, deadlines)
are routing/metrics.py's, in the same registry.
"""

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from frontend_gateway.routing.metrics import ModelRoutingMetrics, RoutingCollectors

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_TOKEN_BUCKETS = (1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 131072)


class ModelMetrics:
    """The per-model children, resolved once (label resolution costs more than the observation)."""

    __slots__ = (
        "_parent",
        "_requests",
        "inflight",
        "input_tokens",
        "input_tokens_total",
        "inter_token_latency",
        "model",
        "output_tokens",
        "output_tokens_total",
        "request_duration",
        "ttft",
    )

    def __init__(self, parent: "GatewayMetrics", model: str) -> None:
        self._parent = parent
        self.model = model
        self.inflight = parent.inflight.labels(model=model)
        self.ttft = parent.ttft.labels(model=model)
        self.inter_token_latency = parent.inter_token_latency.labels(model=model)
        self.request_duration = parent.request_duration.labels(model=model)
        self.input_tokens = parent.input_tokens.labels(model=model)
        self.output_tokens = parent.output_tokens.labels(model=model)
        self.input_tokens_total = parent.input_tokens_total.labels(model=model)
        self.output_tokens_total = parent.output_tokens_total.labels(model=model)
        self._requests: dict[tuple[str, bool, str], Any] = {}

    def finished(
        self,
        *,
        endpoint: str,
        streaming: bool,
        status: str,
        duration: float,
        prompt_tokens: int,
        completion_tokens: int,
    ) -> None:
        key = (endpoint, streaming, status)
        requests = self._requests.get(key)
        if requests is None:
            requests = self._requests[key] = self._parent.requests.labels(
                model=self.model, endpoint=endpoint, request_type="stream" if streaming else "unary", status=status
            )
        requests.inc()
        self.request_duration.observe(duration)
        self.input_tokens.observe(prompt_tokens)
        self.output_tokens.observe(completion_tokens)
        self.input_tokens_total.inc(prompt_tokens)
        self.output_tokens_total.inc(completion_tokens)


class GatewayMetrics:
    """All the gateway's collectors, in their own registry."""

    def __init__(self, prefix: str = "flotilla_frontend") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            f"{prefix}_requests",
            "Requests finished, by outcome.",
            ["model", "endpoint", "request_type", "status"],
            registry=r,
        )
        self.errors = Counter(
            f"{prefix}_errors",
            "Requests answered with an error, by error type and HTTP status.",
            ["error_type", "status_code"],
            registry=r,
        )
        self.inflight = Gauge(f"{prefix}_inflight_requests", "Requests being served now.", ["model"], registry=r)
        self.ttft = Histogram(
            f"{prefix}_time_to_first_token_seconds",
            "Time from request to first text.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            f"{prefix}_inter_token_latency_seconds",
            "Mean time between output tokens after the first, one observation per streamed request.",
            ["model"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.request_duration = Histogram(
            f"{prefix}_request_duration_seconds",
            "Time from request to last byte.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.input_tokens = Histogram(
            f"{prefix}_input_sequence_tokens",
            "Prompt length in tokens.",
            ["model"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.output_tokens = Histogram(
            f"{prefix}_output_sequence_tokens",
            "Completion length in tokens.",
            ["model"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.queued_requests = Gauge(
            f"{prefix}_queued_requests", "Requests waiting for a generation slot (admission queue).", registry=r
        )
        self.rejected = Counter(
            f"{prefix}_admission_rejected",
            "Requests refused by admission control: queue_full (429) or queue_timeout (503).",
            ["reason"],
            registry=r,
        )
        self.input_tokens_total = Counter(f"{prefix}_input_tokens", "Prompt tokens.", ["model"], registry=r)
        self.output_tokens_total = Counter(f"{prefix}_output_tokens", "Completion tokens.", ["model"], registry=r)
        self.refused_instances = Counter(
            f"{prefix}_refused_instances",
            "Worker instances kept out of a model's pool because their card differs from the pool's.",
            ["model", "reason"],
            registry=r,
        )
        self.api_key_records_skipped = Counter(
            f"{prefix}_api_key_records_skipped",
            "API key records in etcd skipped as not the control plane's (forged, altered, malformed, out of "
            "bounds, or older than one applied), by reason; the other records still apply.",
            ["reason"],
            registry=r,
        )
        self.slow_clients_dropped = Counter(
            f"{prefix}_slow_clients_dropped",
            "Clients dropped for slowness: head (its request headers did not arrive within --header-timeout), "
            "body (its request body did not arrive within --body-timeout: a 408) or send (it took none of its "
            "response for --send-timeout: its connection aborted).",
            ["reason"],
            registry=r,
        )
        self.request_records_dropped = Counter(
            f"{prefix}_request_records_dropped",
            "Request log records not sent to the control plane, by reason: nats_unavailable, publish_failed or "
            "buffer_full (the requests themselves were served).",
            ["reason"],
            registry=r,
        )
        self._models: dict[str, ModelMetrics] = {}
        self.routing = RoutingCollectors(r)
        self._routing: dict[str, ModelRoutingMetrics] = {}

    def for_routing(self, model: str) -> ModelRoutingMetrics:
        """``model``'s routing health (its router's and its remote engine's), counted here."""
        found = self._routing.get(model)
        if found is None:
            found = self._routing[model] = ModelRoutingMetrics(self.routing, model)
        return found

    def for_model(self, model: str) -> ModelMetrics:
        found = self._models.get(model)
        if found is None:
            found = self._models[model] = ModelMetrics(self, model)
        return found

    def error(self, error_type: str, status_code: int) -> None:
        self.errors.labels(error_type=error_type, status_code=str(status_code)).inc()

    def admission_rejected(self, reason: str) -> None:
        self.rejected.labels(reason=reason).inc()

    def refused_instance(self, model: str, reason: str) -> None:
        """Count an instance refused from ``model``'s pool; ``reason`` names the differing card fields."""
        self.refused_instances.labels(model=model, reason=reason).inc()

    def api_key_record_skipped(self, reason: str) -> None:
        """Count an API key record the ingress skipped; ``reason`` is BadRecord.reason, or "older"."""
        self.api_key_records_skipped.labels(reason=reason).inc()

    def slow_client_dropped(self, reason: str) -> None:
        """Count a client dropped for slowness; ``reason`` is "head", "body" or "send"."""
        self.slow_clients_dropped.labels(reason=reason).inc()

    def request_records_dropped_count(self, reason: str, count: int) -> None:
        """Count ``count`` request log records dropped for ``reason`` (frontend_gateway/request_log.py)."""
        self.request_records_dropped.labels(reason=reason).inc(count)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
