"""The bounds a group's count is held within: its in-flight work, and the pipeline's GPU budget."""

import math
from collections.abc import Sequence
from dataclasses import dataclass

from planner.observation import GroupObservation
from planner.settings import LoadThresholds, Role


def in_flight_floor(group: GroupObservation, thresholds: LoadThresholds) -> tuple[int, str]:
    """The fewest replicas that hold the group's work in flight without any going over a load mode "up"
    threshold (its KV blocks in use, its queued prompt tokens), and what set it; (0, "") when unknown.

    A scale-down drains: the replicas removed take no new requests and finish theirs, whose KV the others
    then no longer have to hold; but the requests that arrive meanwhile land on the others, which must not
    be pushed into a scale-up at once.
    """
    kv = sum(load.kv_usage or 0.0 for load in group.loads)
    queued = sum(load.queued_prefill_tokens or 0.0 for load in group.loads)
    by_kv = math.ceil(kv / thresholds.kv_usage_up - 1e-9) if group.role != "prefill" else 0
    by_queue = math.ceil(queued / thresholds.prefill_queue_up_tokens - 1e-9) if group.role != "decode" else 0
    if by_kv >= by_queue and by_kv > 0:
        return by_kv, f"the KV in use ({kv:.2f} replicas' worth) needs {by_kv} under {thresholds.kv_usage_up:.0%}"
    if by_queue > 0:
        return by_queue, f"the queued prompt tokens ({queued:,.0f}) need {by_queue}"
    return 0, ""


def drain_order(group: GroupObservation, count: int) -> tuple[int, ...]:
    """The ``count`` replicas to drain first: the least busy (fewest requests in flight, then least KV)."""
    ranked = sorted(group.loads, key=lambda load: (load.active_requests, load.kv_usage or 0.0, load.instance_id))
    return tuple(load.instance_id for load in ranked[: max(0, count)])


@dataclass(frozen=True)
class Ask:
    """One group's count before the budget: where it is, where it would go, its GPUs each, its floor."""

    role: Role
    current: int
    desired: int
    gpus_per_replica: int
    min_replicas: int


def fit_budget(asks: Sequence[Ask], budget: int | None) -> dict[Role, int]:
    """Each group's count within ``budget`` GPUs for all of them together.

    Within the budget, every ask is granted. Over it, no group grows past what the budget leaves: growth is
    handed out one replica at a time to the group furthest (by share) from what it asked, so two groups
    that both need more share the room. If even the groups' current counts do not fit (the budget was
    lowered), the group with the most GPUs gives one up at a time, never below its minimum.
    """
    granted = {ask.role: ask.desired for ask in asks}
    if budget is None or _gpus(asks, granted) <= budget:
        return granted
    granted = {ask.role: min(ask.current, ask.desired) for ask in asks}
    while _gpus(asks, granted) > budget:
        shrinkable = [a for a in asks if a.gpus_per_replica > 0 and granted[a.role] > a.min_replicas]
        if not shrinkable:
            return granted
        largest = max(shrinkable, key=lambda a: granted[a.role] * a.gpus_per_replica)
        granted[largest.role] -= 1
    while True:
        room = budget - _gpus(asks, granted)
        growing = [a for a in asks if granted[a.role] < a.desired and a.gpus_per_replica <= room]
        if not growing:
            return granted
        neediest = max(growing, key=lambda a: (a.desired - granted[a.role]) / a.desired)
        granted[neediest.role] += 1


def _gpus(asks: Sequence[Ask], counts: dict[Role, int]) -> int:
    return sum(ask.gpus_per_replica * counts[ask.role] for ask in asks)
