"""Hysteresis, cooldown, no flapping, and a prompt scale-up, in simulated time."""

import itertools
import random
from collections.abc import Callable

from planner import Decision, GroupObservation, Planner, Stability, Targets
from tests.planner.factories import flat_profile, group, observation, replica, targets

STEADY = Stability()  # the defaults: 15% margin, 60 s cooldown and between reversals, 180 s scale-down window


def test_sla_mode_scales_down_only_when_the_load_fits_one_fewer_replica_with_the_margin() -> None:
    planner = Planner()
    # 3 replicas, 26 req/s needs 2.6 at 10 req/s each: it fits in 3 but not in 2.
    (held,) = planner.decide(0.0, targets(), observation(group("prefill", 3), rate=26.0), flat_profile())
    assert held.desired == 3
    assert "needs 2.6 prefill replicas at 10.0 req/s each: not enough to spare for one fewer" in held.reason
    # 18 req/s needs 1.8: two replicas would be 90% busy, over the 85% the margin allows.
    (held,) = planner.decide(10.0, targets(), observation(group("prefill", 3), rate=18.0), flat_profile())
    assert held.desired == 3
    # 17 req/s needs 1.7: two replicas at 85%.
    (down,) = planner.decide(20.0, targets(), observation(group("prefill", 3), rate=17.0), flat_profile())
    assert (down.desired, down.drain) == (2, 1)
    assert "fits in 2 replicas with the margin" in down.reason


def test_a_group_holds_during_its_cooldown_and_says_so() -> None:
    planner = Planner()
    settings = targets(stability=Stability(cooldown_s=60, reversal_s=60, down_window_s=0))
    (up,) = planner.decide(0.0, settings, observation(group("decode", 2, kv=0.9)))
    assert up.desired == 3
    (held,) = planner.decide(30.0, settings, observation(group("decode", 3, kv=0.9)))
    assert (held.wanted, held.desired, held.bound) == (4, 3, "cooldown")
    assert "held at 3 by changed 30 s ago (cooldown 60 s)" in held.reason
    (again,) = planner.decide(60.0, settings, observation(group("decode", 3, kv=0.9)))
    assert again.desired == 4


def test_a_reversal_within_a_minute_is_held_even_without_a_cooldown() -> None:
    planner = Planner()
    settings = targets(stability=Stability(cooldown_s=0, reversal_s=60, down_window_s=0))
    (up,) = planner.decide(0.0, settings, observation(group("decode", 2, kv=0.9)))
    assert up.desired == 3
    (held,) = planner.decide(20.0, settings, observation(group("decode", 3, kv=0.05)))
    assert (held.wanted, held.desired, held.bound) == (2, 3, "reversal")
    assert "scaled up 20 s ago (no reversal within 60 s)" in held.reason
    (down,) = planner.decide(60.0, settings, observation(group("decode", 3, kv=0.05)))
    assert down.desired == 2


def _direction_changes(history: list[tuple[float, int]]) -> list[float]:
    """The moments a change went the other way from the one before it."""
    return [t for (_, before), (t, after) in itertools.pairwise(history) if before != after]


def _assert_no_flapping(history: list[tuple[float, int]]) -> None:
    reversals = _direction_changes(history)
    for earlier, later in itertools.pairwise(reversals):
        assert later - earlier >= 60.0, history
    changes = [t for t, _ in history]
    for earlier, later in itertools.pairwise(changes):
        if later in reversals:
            assert later - earlier >= 60.0, history


def _run(decide: Callable[[float, int], Decision], start: int) -> list[tuple[float, int]]:
    replicas, history = start, list[tuple[float, int]]()
    for step in range(120):  # ten minutes, one decision every 5 s
        now = step * 5.0
        decision = decide(now, replicas)
        if decision.change:
            history.append((now, 1 if decision.change > 0 else -1))
            replicas = decision.desired
    return history


def test_no_more_than_one_direction_change_a_minute_under_steady_noisy_load_in_load_mode() -> None:
    rng = random.Random(11)
    for stability in (STEADY, Stability(cooldown_s=0, reversal_s=60, down_window_s=0)):
        planner = Planner()
        settings = targets(stability=stability)

        def decide(now: float, replicas: int, planner: Planner = planner, settings: Targets = settings) -> Decision:
            # KV in use worth 1.6 replicas, spread evenly, each replica's share noisy by ±0.1.
            loads = tuple(replica(i, kv=min(1.0, 1.6 / replicas + rng.uniform(-0.1, 0.1))) for i in range(replicas))
            (decision,) = planner.decide(now, settings, observation(GroupObservation("decode", replicas, 1, loads)))
            return decision

        history = _run(decide, start=2)
        _assert_no_flapping(history)
        assert len(history) <= 2


def test_no_more_than_one_direction_change_a_minute_under_steady_noisy_load_in_sla_mode() -> None:
    rng = random.Random(5)
    bare = Stability(cooldown_s=0, reversal_s=60, down_window_s=0)  # the reversal rule alone
    for predictor, stability in (("constant", STEADY), ("trend", STEADY), ("constant", bare), ("trend", bare)):
        planner = Planner(predictor)
        settings = targets(predictor=predictor, stability=stability)

        def decide(now: float, replicas: int, planner: Planner = planner, settings: Targets = settings) -> Decision:
            rate = 20.0 + rng.gauss(0, 2.0)  # a need of about 2 replicas, ± 0.2
            obs = observation(group("prefill", replicas), rate=rate)
            (decision,) = planner.decide(now, settings, obs, flat_profile())
            return decision

        history = _run(decide, start=2)
        _assert_no_flapping(history)
        if stability is STEADY:  # with the scale-down window, noise does not move it back and forth at all
            assert len(_direction_changes(history)) <= 1, history


def test_scale_up_is_decided_within_one_interval_of_the_load_crossing_its_threshold() -> None:
    planner = Planner()
    settings = targets(stability=STEADY)
    for step in range(12):  # a settled minute under the threshold
        (decision,) = planner.decide(step * 5.0, settings, observation(group("decode", 2, kv=0.6)))
        assert decision.desired == 2
    (decision,) = planner.decide(60.0, settings, observation(group("decode", 2, kv=0.82)))
    assert decision.desired == 3


def test_sla_scale_up_is_decided_within_one_interval_of_the_rate_crossing_what_the_replicas_carry() -> None:
    for predictor in ("constant", "trend"):
        planner = Planner(predictor)
        settings = targets(predictor=predictor, stability=STEADY)
        for step in range(12):
            (decision,) = planner.decide(
                step * 5.0, settings, observation(group("prefill", 2), rate=15.0), flat_profile()
            )
            assert decision.desired == 2
        (decision,) = planner.decide(60.0, settings, observation(group("prefill", 2), rate=25.0), flat_profile())
        assert decision.desired == 3, predictor


def test_a_disabled_planner_holds_every_group_and_says_so() -> None:
    obs = observation(group("prefill", 1, queued=50000), group("decode", 1, kv=1.0, first_id=5))
    decisions = Planner().decide(0.0, targets(enabled=False), obs, flat_profile())
    assert [(d.mode, d.desired, d.acts) for d in decisions] == [("off", 1, False), ("off", 1, False)]
    assert decisions[0].reason == "planner off for this pipeline"


def test_advisory_decisions_are_made_and_recorded_but_do_not_act() -> None:
    planner = Planner()
    settings = targets(advisory=True, stability=STEADY)
    (decision,) = planner.decide(0.0, settings, observation(group("decode", 2, kv=0.9)))
    assert (decision.desired, decision.advisory, decision.acts) == (3, True, False)
    assert decision.reason.endswith("; advisory: not acted on")
    (later,) = planner.decide(10.0, settings, observation(group("decode", 2, kv=0.9)))
    assert later.bound == "cooldown"  # what acting would have done: wait for the new replica


def test_a_quiet_interval_in_noisy_traffic_does_not_remove_a_replica_within_the_scale_down_window() -> None:
    planner = Planner()
    settings = targets(stability=STEADY)
    for step, rate in enumerate((26.0, 25.0, 27.0, 12.0)):  # 3 replicas' worth, then one quiet interval
        (decision,) = planner.decide(step * 30.0, settings, observation(group("prefill", 3), rate=rate), flat_profile())
    assert (decision.wanted, decision.desired, decision.bound) == (2, 3, "down_window")
    assert "held at 3 by 3 replicas asked for within 180 s" in decision.reason
    for step in range(4, 12):
        (decision,) = planner.decide(step * 30.0, settings, observation(group("prefill", 3), rate=12.0), flat_profile())
        if decision.change:
            break
    assert decision.desired == 2
    assert step * 30.0 - 60.0 >= 180.0  # the last busy interval (at 60 s) has left the window
