"""The figures of one metric sample, computed from the request log's rows of a window and the workers' and nodes'
latest reports. Pure: the recorder (controlplane/traffic/recorder.py) gathers the inputs and writes the rows."""

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from controlplane.traffic.models import RequestRecord


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values``, linearly interpolated between the two nearest ranks (as
    NumPy's default and Prometheus's ``histogram_quantile`` within a bucket do); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    below, above = math.floor(rank), math.ceil(rank)
    return ordered[below] + (ordered[above] - ordered[below]) * (rank - below)


@dataclass(frozen=True)
class Window:
    """What is known of the requests of one window (``seconds`` long): their rows."""

    seconds: float
    records: Sequence[RequestRecord]


def request_figures(window: Window) -> dict[str, Any]:
    """The request figures of a MetricSample (its field names) over ``window``: requests and their rate, the share
    that failed, TTFT and ITL percentiles of those that report them, and cached / prompt tokens (None: no prompt
    token was sent). A rate or share of no request is None, not 0."""
    records = window.records
    figures: dict[str, Any] = {"requests": len(records), "requests_per_s": len(records) / window.seconds}
    if not records:
        return {**figures, "error_rate": None}
    figures["error_rate"] = sum(1 for record in records if not record.succeeded) / len(records)
    ttfts = [record.ttft_s for record in records if record.ttft_s is not None]
    itls = [record.itl_s for record in records if record.itl_s is not None]
    figures.update(
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p95_s=percentile(ttfts, 95),
        ttft_p99_s=percentile(ttfts, 99),
        itl_p50_s=percentile(itls, 50),
        itl_p95_s=percentile(itls, 95),
    )
    counted = [record for record in records if record.cached_tokens is not None]
    prompt = sum(record.prompt_tokens for record in counted)
    figures["prefix_hit_rate"] = sum(record.cached_tokens or 0 for record in counted) / prompt if prompt else None
    return figures


def load_figures(loads: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The load figures of a MetricSample over instances' latest loads (as the live bridge keeps them): requests
    waiting summed (``queue_depth``) and the mean KV use; None where no instance reports one."""
    waiting, usage = [], []
    for load in loads:
        if _number(load.get("waiting")):
            waiting.append(float(load["waiting"]))
        if _number(load.get("kv_usage")):
            usage.append(float(load["kv_usage"]))
    return {
        "queue_depth": sum(waiting) if waiting else None,
        "kv_usage": sum(usage) / len(usage) if usage else None,
    }


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value  # not NaN
