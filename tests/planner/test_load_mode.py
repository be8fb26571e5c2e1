"""Load mode: thresholds on queued prompt tokens and KV usage, one replica at a time."""

from planner import GroupObservation, Planner
from tests.planner.factories import group, observation, replica, targets


def decide_one(g: GroupObservation) -> tuple[int, str, str]:
    (decision,) = Planner().decide(100.0, targets(), observation(g))
    return decision.desired, decision.mode, decision.reason


def test_a_prefill_replica_over_the_queue_threshold_adds_one_replica() -> None:
    g = GroupObservation("prefill", 2, 1, (replica(1, queued=9000), replica(2, queued=100)))
    desired, mode, reason = decide_one(g)
    assert (desired, mode) == (3, "load")
    assert "instance 1's queued prompt tokens 9,000 at or over 8,192" in reason


def test_a_decode_replica_over_the_kv_threshold_adds_one_replica() -> None:
    g = GroupObservation("decode", 2, 1, (replica(1, kv=0.5), replica(2, kv=0.85)))
    desired, _, reason = decide_one(g)
    assert desired == 3
    assert "instance 2's KV usage 85% at or over 80%" in reason


def test_every_replica_under_the_down_thresholds_removes_one_replica_and_drains_the_least_busy() -> None:
    g = GroupObservation(
        "decode", 3, 1, (replica(1, kv=0.2, active=4), replica(2, kv=0.1, active=1), replica(3, kv=0.3, active=6))
    )
    (decision,) = Planner().decide(100.0, targets(), observation(g))
    assert (decision.current, decision.desired, decision.drain, decision.drain_instances) == (3, 2, 1, (2,))
    assert "fits in 2 replicas with the margin" in decision.reason
    assert "drain 1 replica (instance 2: 1 request in flight to finish first)" in decision.reason


def test_a_scale_down_that_would_push_the_rest_over_the_up_threshold_is_not_made() -> None:
    # 0.4 each on 2 replicas is 0.8 on one: at the "up" threshold, so it would be undone at once.
    desired, _, reason = decide_one(group("decode", 2, kv=0.4))
    assert desired == 2
    assert "not with one replica fewer" in reason


def test_load_between_the_thresholds_holds() -> None:
    desired, _, reason = decide_one(group("decode", 2, kv=0.6))
    assert desired == 2
    assert "load within thresholds (busiest KV usage 60%)" in reason


def test_an_aggregated_group_is_judged_by_both_queue_and_kv() -> None:
    assert decide_one(group("aggregated", 2, queued=10000, kv=0.1))[0] == 3
    assert decide_one(group("aggregated", 2, queued=0, kv=0.9))[0] == 3
    assert decide_one(group("aggregated", 2, queued=5000, kv=0.1))[0] == 2  # the queue is not idle enough
    assert decide_one(group("aggregated", 2, queued=0, kv=0.1))[0] == 1


def test_replicas_still_starting_hold_a_load_mode_scale_up() -> None:
    starting = GroupObservation("decode", 3, 1, (replica(1, kv=0.9), replica(2, kv=0.9)))
    (decision,) = Planner().decide(100.0, targets(), observation(starting))
    assert (decision.wanted, decision.desired, decision.bound) == (4, 3, "starting")
    assert "waiting for 1 replica starting to take load" in decision.reason


def test_a_group_with_no_load_reported_holds_and_says_so() -> None:
    desired, _, reason = decide_one(group("decode", 2, kv=None))
    assert desired == 2
    assert "no replica reported KV usage: holding" in reason
