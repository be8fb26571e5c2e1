"""A pipeline's recent time to first token (p95), the one figure the TTFT rule reads.

Until the control plane keeps metric history of its own, it comes from the gateway's Prometheus
``/metrics`` (``FLOTILLA_GATEWAY_URL``, as the overview reads it): the TTFT histogram of the pipeline's
served name, as the difference between this reading and the previous one (kept in Django's cache), so
that it is the p95 of the requests since the last pass, not since the gateway started. None when there is
no gateway URL, the gateway does not answer (logged), there is no previous reading yet, or no request came.
The p95 is the upper bound of the histogram bucket it falls in (the gateway's buckets are what it knows);
past the largest bound, that bound.
"""

import logging
import math

from django.core.cache import cache
from prometheus_client.parser import text_string_to_metric_families

from controlplane.dashboard.gateway import PREFIX, GatewayUnreachable, gateway_url, read_metrics_text
from controlplane.deployments.models import Pipeline
from runtime.errors import ConfigError

log = logging.getLogger(__name__)

_BUCKET = f"{PREFIX}_time_to_first_token_seconds_bucket"
_CACHE_KEY = "alerts:ttft-buckets:{}"
# Kept a little longer than a few passes: an older reading would average over too long a time.
_CACHE_S = 300


def ttft_buckets(text: str, model: str) -> dict[float, float]:
    """The cumulative TTFT bucket counts (by upper bound, seconds) of ``model`` in a Prometheus text
    exposition. Raises ValueError when it is not one."""
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == _BUCKET and sample.labels.get("model") == model:
                buckets[float(sample.labels["le"])] = float(sample.value)
    return buckets


def p95_ms(current: dict[float, float], previous: dict[float, float]) -> float | None:
    """The p95 in milliseconds of the requests counted between two readings of cumulative buckets; None when
    none came or a counter went down (the gateway restarted)."""
    deltas = {le: count - previous.get(le, 0.0) for le, count in current.items()}
    if not deltas or any(delta < 0 for delta in deltas.values()):
        return None
    total = deltas.get(math.inf, max(deltas.values()))
    if total <= 0:
        return None
    for le in sorted(deltas):
        if deltas[le] >= 0.95 * total:
            return le * 1000 if math.isfinite(le) else max((b for b in deltas if math.isfinite(b)), default=0) * 1000
    return None


def recent_ttft_p95(pipeline: Pipeline) -> float | None:
    """``pipeline``'s TTFT p95 in milliseconds since the previous call, or None (see the module)."""
    try:
        url = gateway_url()
    except ConfigError as exc:
        log.warning("TTFT not read for the alert of %s: %s", pipeline.name, exc)
        return None
    if url is None:
        return None
    try:
        current = ttft_buckets(read_metrics_text(url), pipeline.name)
    except (GatewayUnreachable, ValueError) as exc:
        log.warning("TTFT not read for the alert of %s: %s", pipeline.name, exc)
        return None
    key = _CACHE_KEY.format(pipeline.pk)
    previous = cache.get(key)
    cache.set(key, current, _CACHE_S)
    return None if previous is None else p95_ms(current, previous)
