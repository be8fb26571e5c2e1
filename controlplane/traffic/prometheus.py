"""The charts' history from Prometheus, where one is configured (``FLOTILLA_PROMETHEUS_URL``), instead of the
control plane's own samples.

One ``query_range`` per figure (https://prometheus.io/docs/prometheus/latest/querying/api/#range-queries) over
the metric names the gateway (frontend_gateway/metrics.py, ``flotilla_frontend_*``, labelled by ``model``) and the
workers (launcher/worker_metrics.py, ``flotilla_worker_*``) export. A pipeline's figures are the gateway's for its
served name; the workers' series carry no model label, so queue depth and KV use are fleet-wide only (None for a
pipeline). Node figures are not in Prometheus's default exports: the node scope keeps reading the samples.

Errors are ``PrometheusError`` with a message that names the server: the history view shows it instead of a chart.
"""

import math
from typing import Any

import httpx

from controlplane.errors import ControlPlaneError

_RATE = "[1m]"


class PrometheusError(ControlPlaneError):
    """Prometheus did not answer, or not with a range query's result; the message says which server and why."""


def _selector(model: str | None) -> str:
    if model is None:
        return ""
    escaped = model.replace("\\", "\\\\").replace('"', '\\"')
    return f'{{model="{escaped}"}}'


def queries(model: str | None) -> dict[str, str]:
    """PromQL per MetricSample field, for the fleet (``model`` None) or one served name."""
    selector = _selector(model)
    requests = f"sum(rate(flotilla_frontend_requests_total{selector}{_RATE}))"
    errors_selector = _selector_with(model, 'status="error"')
    found = {
        "requests_per_s": requests,
        "error_rate": f"sum(rate(flotilla_frontend_requests_total{errors_selector}{_RATE})) / {requests}",
    }
    for field, metric, quantile in (
        ("ttft_p50_s", "time_to_first_token_seconds", 0.5),
        ("ttft_p95_s", "time_to_first_token_seconds", 0.95),
        ("ttft_p99_s", "time_to_first_token_seconds", 0.99),
        ("itl_p50_s", "inter_token_latency_seconds", 0.5),
        ("itl_p95_s", "inter_token_latency_seconds", 0.95),
    ):
        found[field] = (
            f"histogram_quantile({quantile}, sum by (le) (rate(flotilla_frontend_{metric}_bucket{selector}{_RATE})))"
        )
    if model is None:
        found["queue_depth"] = "sum(flotilla_worker_waiting_requests)"
        found["kv_usage"] = "avg(flotilla_worker_kv_usage_ratio)"
    return found


def _selector_with(model: str | None, extra: str) -> str:
    inner = _selector(model)[1:-1] if model is not None else ""
    return "{" + ",".join(part for part in (inner, extra) if part) + "}"


class PrometheusReader:
    """Reads the charts' series from the Prometheus at ``base_url``."""

    def __init__(self, base_url: str, *, timeout_s: float = 5.0, transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._timeout_s = timeout_s
        self._transport = transport

    def query_range(self, query: str, start: float, end: float, step: float) -> list[tuple[float, float | None]]:
        """The first series of a range query as (Unix time, value) pairs; [] when it has none. NaN (a rate of no
        request) is None. Raises PrometheusError."""
        params = {"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
        try:
            with httpx.Client(timeout=self._timeout_s, transport=self._transport) as client:
                response = client.get(f"{self.base_url}/api/v1/query_range", params=params)
            body = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise PrometheusError(f"Prometheus at {self.base_url} did not answer a range query: {exc}") from exc
        if not isinstance(body, dict) or body.get("status") != "success":
            error = body.get("error") if isinstance(body, dict) else None
            raise PrometheusError(
                f"Prometheus at {self.base_url} refused {query!r}: {error or f'HTTP {response.status_code}'}"
            )
        data = body.get("data")
        if not isinstance(data, dict) or data.get("resultType") != "matrix" or not isinstance(data.get("result"), list):
            raise PrometheusError(f"Prometheus at {self.base_url} answered {query!r} without a matrix")
        if not data["result"]:
            return []
        return [(float(at), _value(text)) for at, text in data["result"][0].get("values", [])]

    def history(self, model: str | None, start: float, end: float, step: float) -> dict[str, Any]:
        """The charts' data, as ``history.sample_history`` shapes it: ``times`` and a column per figure (None
        where Prometheus has no point). Raises PrometheusError."""
        columns: dict[str, dict[float, float | None]] = {}
        times: set[float] = set()
        for field, query in queries(model).items():
            points = dict(self.query_range(query, start, end, step))
            columns[field] = points
            times.update(points)
        ordered = sorted(times)
        return {
            "times": ordered,
            "series": {field: [points.get(at) for at in ordered] for field, points in columns.items()},
            "source": "prometheus",
        }


def _value(text: Any) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) or math.isinf(value) else value
