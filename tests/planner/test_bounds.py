"""Bounds: min and max replicas, the pipeline's GPU budget, the in-flight work, one removal at a time."""

from planner import GroupObservation, Planner
from planner.bounds import Ask, fit_budget
from tests.planner.factories import flat_profile, group, observation, replica, targets


def test_max_replicas_limits_a_scale_up_and_is_named_in_the_reason() -> None:
    obs = observation(group("prefill", 2), rate=55.0)  # 5.5 replicas' worth
    (decision,) = Planner().decide(0.0, targets(max_replicas=4), obs, flat_profile())
    assert (decision.wanted, decision.desired, decision.bound) == (6, 4, "max_replicas")
    assert decision.reason.endswith("needs 6 prefill replicas at 10.0 req/s each; held at 4 by max replicas 4")


def test_min_replicas_raises_a_group_under_it_and_is_named_in_the_reason() -> None:
    (decision,) = Planner().decide(0.0, targets(min_replicas=2), observation(group("decode", 1, kv=0.5)))
    assert (decision.wanted, decision.desired, decision.bound) == (1, 2, "min_replicas")
    assert "held at 2 by min replicas 2" in decision.reason


def test_the_gpu_budget_limits_a_scale_up_and_is_named_in_the_reason() -> None:
    obs = observation(group("prefill", 1, gpus=2), group("decode", 2, gpus=2, first_id=10), rate=25.0)
    prefill, decode = Planner().decide(0.0, targets(gpu_budget=10), obs, flat_profile())
    # Asked: 3 prefill and 3 decode of 2 GPUs each, 12 GPUs; the budget leaves room for 2 more replicas in all,
    # which go to the group furthest from its ask: prefill (1 of 3), then either (2 of 3 each).
    assert (prefill.desired, decode.desired) == (3, 2)
    assert (prefill.bound, decode.bound) == (None, "gpu_budget")
    assert decode.reason.endswith(
        "needs 3 decode replicas at 10.0 req/s each; held at 2 by GPU budget 10: 10 GPUs with 2 here"
    )


def test_two_groups_over_the_budget_share_the_room_by_how_far_each_is_from_its_ask() -> None:
    asks = [Ask("prefill", 1, 5, 1, 1), Ask("decode", 1, 3, 1, 1)]
    assert fit_budget(asks, 6) == {"prefill": 4, "decode": 2}
    assert fit_budget(asks, 100) == {"prefill": 5, "decode": 3}
    assert fit_budget([Ask("aggregated", 1, 9, 0, 1)], 0) == {"aggregated": 9}  # CPU replicas cost no GPU


def test_a_lowered_budget_shrinks_the_largest_group_but_never_below_its_minimum() -> None:
    asks = [Ask("prefill", 2, 2, 2, 1), Ask("decode", 4, 4, 2, 1)]
    assert fit_budget(asks, 8) == {"prefill": 2, "decode": 2}
    assert fit_budget(asks, 2) == {"prefill": 1, "decode": 1}  # the minimums need 4: as near as it goes


def test_a_budget_too_small_for_the_minimums_says_so() -> None:
    obs = observation(group("prefill", 2, gpus=4), group("decode", 2, gpus=4, first_id=10), rate=25.0)
    decisions = Planner().decide(0.0, targets(min_replicas=2, gpu_budget=8), obs, flat_profile())
    assert [d.bound for d in decisions] == ["gpu_budget", "gpu_budget"]
    assert all(
        d.reason.endswith("held at 2 by min replicas: they need 16 GPUs, over the GPU budget 8") for d in decisions
    )


def test_a_scale_down_never_goes_below_the_replicas_the_in_flight_kv_needs() -> None:
    # The load asks for 1 replica, but 4 replicas hold KV worth 1.8 replicas at the 80% "up" threshold: 3 stay.
    loads = tuple(replica(i, kv=0.45, active=3) for i in range(4))
    obs = observation(GroupObservation("decode", 4, 1, loads), rate=1.0)
    (decision,) = Planner().decide(0.0, targets(), obs, flat_profile())
    assert (decision.wanted, decision.desired, decision.bound) == (1, 3, "in_flight")
    assert "held at 3 by the KV in use (1.80 replicas' worth) needs 3 under 80%" in decision.reason
    assert decision.drain == 1
    assert "drain 1 replica (instance 0: 3 requests in flight to finish first)" in decision.reason


def test_a_scale_down_removes_at_most_one_replica_at_once_and_drains_the_least_busy() -> None:
    loads = (replica(1, active=5), replica(2, active=0), replica(3, active=2), replica(4, active=9))
    obs = observation(GroupObservation("prefill", 4, 1, loads), rate=1.0)
    (decision,) = Planner().decide(0.0, targets(), obs, flat_profile())
    assert (decision.wanted, decision.desired, decision.bound) == (1, 3, "step")
    assert decision.drain_instances == (2,)
