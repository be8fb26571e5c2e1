"""The overview's KV figures: each pipeline's latest instance loads (as the bridge pushes them to the pipeline
pages) summed per pipeline, for the ``fleet.load`` group.

``summarise`` is pure; the bridge (controlplane/live/bridge.py) keeps the loads and sends the partial
(controlplane/dashboard/partials.py ``render_fleet_load``) at most once per interval.
"""

from collections.abc import Iterable, Mapping
from typing import Any


def summarise(loads: Iterable[tuple[int, Mapping[str, Any]]]) -> dict[int, dict[str, float]]:
    """Per pipeline id, over its instances' latest loads (``(pipeline id, load)`` pairs): ``instances``
    reporting, the mean ``kv_usage`` and ``prefix_hit_rate`` of those that report them, and ``running``,
    ``waiting``, ``active_requests`` and ``tokens_per_s`` summed. A figure no instance reports is left out."""
    by_pipeline: dict[int, list[Mapping[str, Any]]] = {}
    for pipeline_id, load in loads:
        by_pipeline.setdefault(pipeline_id, []).append(load)
    summary: dict[int, dict[str, float]] = {}
    for pipeline_id, pipeline_loads in by_pipeline.items():
        figures: dict[str, float] = {"instances": len(pipeline_loads)}
        for name in ("kv_usage", "prefix_hit_rate"):
            values = [float(load[name]) for load in pipeline_loads if _is_number(load.get(name))]
            if values:
                figures[name] = sum(values) / len(values)
        for name in ("running", "waiting", "active_requests", "tokens_per_s"):
            values = [float(load[name]) for load in pipeline_loads if _is_number(load.get(name))]
            if values:
                figures[name] = sum(values)
        summary[pipeline_id] = figures
    return summary


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value  # not NaN
