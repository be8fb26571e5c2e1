"""The charts' history: the metric samples of a scope over the last hour (6 h, 24 h), or Prometheus's series where
``FLOTILLA_PROMETHEUS_URL`` is set (controlplane/traffic/prometheus.py), in one shape for the dashboard's charts
(static/dashboard/history_charts.js)::

    {"times": [unix seconds…], "series": {field: [value or null…]}, "source": "samples" | "prometheus"}
"""

import datetime
from typing import Any

from controlplane.traffic.models import MetricSample

#: The ranges a chart offers, in seconds.
RANGES = {"1h": 3_600, "6h": 21_600, "24h": 86_400}
#: The most points a chart is sent: a day of 10 s samples is thinned to every 12th.
MAX_POINTS = 720

REQUEST_FIELDS = (
    "requests_per_s",
    "error_rate",
    "ttft_p50_s",
    "ttft_p95_s",
    "ttft_p99_s",
    "itl_p50_s",
    "itl_p95_s",
    "prefix_hit_rate",
    "queue_depth",
    "kv_usage",
)
NODE_FIELDS = (
    "memory_used_bytes",
    "memory_total_bytes",
    "gpu_memory_used_bytes",
    "gpu_memory_total_bytes",
    "gpu_utilization_percent",
    "cpu_utilization_percent",
)


def sample_history(
    scope: str, object_id: int | None, seconds: int, now: datetime.datetime | None = None
) -> dict[str, Any]:
    """The samples of ``scope`` (``fleet``, ``pipeline`` or ``node`` with ``object_id``) over the last ``seconds``,
    oldest first, thinned to at most MAX_POINTS."""
    now = now or datetime.datetime.now(tz=datetime.UTC)
    fields = NODE_FIELDS if scope == MetricSample.Scope.NODE else REQUEST_FIELDS
    samples = MetricSample.objects.filter(scope=scope, at__gte=now - datetime.timedelta(seconds=seconds))
    if scope == MetricSample.Scope.PIPELINE:
        samples = samples.filter(pipeline_id=object_id)
    elif scope == MetricSample.Scope.NODE:
        samples = samples.filter(node_id=object_id)
    rows = list(samples.order_by("at").values_list("at", *fields))
    step = max(1, -(-len(rows) // MAX_POINTS))
    rows = rows[::step]
    return {
        "times": [row[0].timestamp() for row in rows],
        "series": {field: [row[index + 1] for row in rows] for index, field in enumerate(fields)},
        "source": "samples",
    }
