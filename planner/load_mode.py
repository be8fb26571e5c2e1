"""Load mode: one replica more when a replica is overloaded, one fewer when all are idle enough.

As the reference's "simple" (load-based) mode: prefill work is judged by the prompt tokens queued on each
replica, decode work by the share of each replica's KV cache in use, an aggregated group by both. Up when
any replica is at or over an "up" threshold; down when every replica is at or under its "down" threshold
and, with one replica fewer, the busiest replica's share of the load, spread over the rest, would stay under
"up" with the stability margin to spare (otherwise the removal would be undone at once).
"""

from dataclasses import dataclass

from planner.observation import GroupObservation, ReplicaLoad
from planner.settings import LoadThresholds
from planner.sizing import Sizing, amount, percent, replicas


@dataclass(frozen=True)
class _Signal:
    name: str
    up: float
    down: float
    fmt: str  # "tokens" or "share"

    def value(self, load: ReplicaLoad) -> float | None:
        return load.queued_prefill_tokens if self.fmt == "tokens" else load.kv_usage

    def show(self, value: float) -> str:
        return amount(value) if self.fmt == "tokens" else percent(value)


def _signals(role: str, thresholds: LoadThresholds) -> list[_Signal]:
    queue = _Signal(
        "queued prompt tokens", thresholds.prefill_queue_up_tokens, thresholds.prefill_queue_down_tokens, "tokens"
    )
    kv = _Signal("KV usage", thresholds.kv_usage_up, thresholds.kv_usage_down, "share")
    if role == "prefill":
        return [queue]
    if role == "decode":
        return [kv]
    return [queue, kv]


def load_sizing(group: GroupObservation, thresholds: LoadThresholds, margin: float) -> Sizing:
    """The replicas ``group``'s per-replica load asks for: its current count, or one more or fewer."""
    current = group.replicas
    signals = _signals(group.role, thresholds)
    measured = [(signal, [(load, signal.value(load)) for load in group.loads]) for signal in signals]
    known = [(s, [(load, v) for load, v in values if v is not None]) for s, values in measured]
    if not any(values for _, values in known):
        return Sizing(current, f"no replica reported {' or '.join(s.name for s in signals)}: holding")
    for signal, values in known:
        over = [(load, v) for load, v in values if v >= signal.up]
        if over:
            load, value = max(over, key=lambda item: item[1])
            return Sizing(
                current + 1,
                f"instance {load.instance_id}'s {signal.name} {signal.show(value)} at or over "
                f"{signal.show(signal.up)}: one replica more",
            )
    peaks = {signal.name: max((v for _, v in values), default=0.0) for signal, values in known}
    summary = ", ".join(f"busiest {s.name} {s.show(peaks[s.name])}" for s, values in known if values)
    unknown = any(len(values) < len(group.loads) for _, values in known) or group.reporting < current
    if current == 0 or unknown:
        return Sizing(current, f"load within thresholds ({summary})")
    if all(peaks[s.name] <= s.down for s, _ in known):
        if current == 1:
            if group.in_flight == 0 and all(peaks[s.name] == 0 for s, _ in known):
                return Sizing(0, "no load and nothing in flight: no replica needed")
            return Sizing(current, f"load under the scale-down thresholds ({summary}), but one replica is the least")
        fits = all(peaks[s.name] * current / (current - 1) < s.up * (1 - margin) for s, _ in known)
        if fits:
            return Sizing(
                current - 1,
                f"every replica under the scale-down thresholds ({summary}): "
                f"the load fits in {replicas(current - 1)} with the margin",
            )
        return Sizing(current, f"under the scale-down thresholds ({summary}), but not with one replica fewer")
    return Sizing(current, f"load within thresholds ({summary})")
