"""The gateway's traffic as the overview shows it, read from its Prometheus ``/metrics``.

``FLOTILLA_GATEWAY_URL`` (the gateway's base URL, e.g. ``http://127.0.0.1:8080``) says where; unset, the
overview says how to set it. Counters only give totals, so rates (requests/s, tokens/s) and the TTFT mean
come from the difference between this reading and the one before it, kept in Django's cache: the first
look shows totals, a later one the rates since the previous look. The decision (``traffic``) is pure;
``read_gateway`` is the I/O.
"""

import math
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from runtime.config import env_str
from runtime.errors import ConfigError

# The gateway's metric names (frontend_gateway/metrics.py, prefix "flotilla_frontend").
PREFIX = "flotilla_frontend"
READ_TIMEOUT_S = 2.0
# A previous reading older than this is not used for rates (they would average over too long).
MAX_RATE_WINDOW_S = 15 * 60.0
MAX_METRICS_BYTES = 4 * 1024 * 1024


class GatewayUnreachable(Exception):
    """The gateway's /metrics could not be read or parsed; the message says why, for the page."""


@dataclass
class ModelCounters:
    """One served model's counters at one moment."""

    requests: float = 0.0
    output_tokens: float = 0.0
    ttft_sum_s: float = 0.0
    ttft_count: float = 0.0
    inflight: float = 0.0


@dataclass
class Reading:
    """The gateway's counters by model, and when they were read (epoch seconds)."""

    at: float
    models: dict[str, ModelCounters] = field(default_factory=dict)
    queued: float = 0.0


@dataclass(frozen=True)
class ModelTraffic:
    """What the overview shows for a model: totals, and rates over ``window_s`` when there is one."""

    model: str
    requests_total: int
    inflight: int
    requests_per_s: float | None
    tokens_per_s: float | None
    ttft_mean_s: float | None  # over the window; over all time when there is no window

    @property
    def ttft_mean_ms(self) -> float | None:
        return None if self.ttft_mean_s is None else self.ttft_mean_s * 1000


@dataclass(frozen=True)
class Traffic:
    models: list[ModelTraffic]
    queued: int
    window_s: float | None  # None: the first reading, so no rates yet


def gateway_url() -> str | None:
    """``FLOTILLA_GATEWAY_URL`` without a trailing slash, or None when it is not set. Raises ConfigError
    when it is not an http(s) URL."""
    url = env_str("FLOTILLA_GATEWAY_URL")
    if not url:
        return None
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"FLOTILLA_GATEWAY_URL must be the gateway's http(s) base URL, not {url[:100]!r}")
    return url.rstrip("/")


def parse_metrics(text: str, at: float) -> Reading:
    """The gateway's counters in a Prometheus text exposition. Raises ValueError when it is not one."""
    reading = Reading(at=at)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, value = sample.name, float(sample.value)
            if name == f"{PREFIX}_queued_requests":
                reading.queued = value
                continue
            model = sample.labels.get("model")
            if model is None:
                continue
            counters = reading.models.setdefault(model, ModelCounters())
            if name == f"{PREFIX}_requests_total":
                counters.requests += value  # summed over endpoint, request type and status
            elif name == f"{PREFIX}_output_tokens_total":
                counters.output_tokens = value
            elif name == f"{PREFIX}_time_to_first_token_seconds_sum":
                counters.ttft_sum_s = value
            elif name == f"{PREFIX}_time_to_first_token_seconds_count":
                counters.ttft_count = value
            elif name == f"{PREFIX}_inflight_requests":
                counters.inflight = value
    return reading


def traffic(current: Reading, previous: Reading | None) -> Traffic:
    """Totals from ``current``; rates over the time since ``previous`` when it is recent, and not from
    before a gateway restart (a counter that went down)."""
    window = None
    if previous is not None and 0 < current.at - previous.at <= MAX_RATE_WINDOW_S:
        window = current.at - previous.at
    rows = []
    for model, now in sorted(current.models.items()):
        before = previous.models.get(model, ModelCounters()) if previous is not None else None
        restarted = before is not None and (now.requests < before.requests or now.ttft_count < before.ttft_count)
        if window is not None and before is not None and not restarted:
            ttft_count = now.ttft_count - before.ttft_count
            ttft_sum = now.ttft_sum_s - before.ttft_sum_s
            requests_per_s: float | None = (now.requests - before.requests) / window
            tokens_per_s: float | None = (now.output_tokens - before.output_tokens) / window
        else:
            ttft_count, ttft_sum = now.ttft_count, now.ttft_sum_s
            requests_per_s = tokens_per_s = None
        rows.append(
            ModelTraffic(
                model=model,
                requests_total=int(now.requests),
                inflight=int(now.inflight),
                requests_per_s=requests_per_s,
                tokens_per_s=tokens_per_s,
                ttft_mean_s=ttft_sum / ttft_count if ttft_count > 0 and math.isfinite(ttft_sum) else None,
            )
        )
    return Traffic(rows, int(current.queued), window)


def read_metrics_text(url: str, *, timeout_s: float = READ_TIMEOUT_S) -> str:
    """The text of ``<url>/metrics``, read once. Raises GatewayUnreachable with the reason."""
    try:
        response = httpx.get(f"{url}/metrics", timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise GatewayUnreachable(f"{url}/metrics could not be read: {exc or type(exc).__name__}") from exc
    if response.status_code != 200:
        raise GatewayUnreachable(f"{url}/metrics answered HTTP {response.status_code}")
    if len(response.content) > MAX_METRICS_BYTES:
        raise GatewayUnreachable(f"{url}/metrics answered more than {MAX_METRICS_BYTES} bytes")
    return response.text


def read_gateway(url: str, *, timeout_s: float = READ_TIMEOUT_S) -> Reading:
    """Read ``<url>/metrics`` once. Raises GatewayUnreachable with the reason."""
    text = read_metrics_text(url, timeout_s=timeout_s)
    try:
        return parse_metrics(text, time.time())
    except ValueError as exc:
        raise GatewayUnreachable(f"{url}/metrics is not in the Prometheus text format: {exc}") from exc
