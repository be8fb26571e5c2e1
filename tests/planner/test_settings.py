"""Targets and settings: per-group overrides, and values that cannot be planned with are refused."""

from collections.abc import Callable

import pytest

from planner import GroupTargets, LoadThresholds, Planner, SettingsError, Stability, Targets
from tests.planner.factories import flat_profile, group, observation


def test_a_group_override_replaces_the_pipeline_targets_for_that_group_only() -> None:
    settings = Targets(
        default=GroupTargets(ttft_s=0.5, itl_s=0.05),
        groups={"prefill": GroupTargets(ttft_s=0.5, itl_s=0.05, max_replicas=2)},
        predictor="constant",
        stability=Stability(cooldown_s=0, down_window_s=0),
    )
    assert settings.for_group("decode") is settings.default
    obs = observation(group("prefill", 1), group("decode", 1, first_id=10), rate=45.0)
    prefill, decode = Planner("constant").decide(0.0, settings, obs, flat_profile())
    assert (prefill.desired, prefill.bound, decode.desired, decode.bound) == (2, "max_replicas", 5, None)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: GroupTargets(min_replicas=3, max_replicas=2), "max_replicas (2) must be at least min_replicas (3)"),
        (lambda: GroupTargets(ttft_s=0), "ttft_s must be a positive number of seconds, not 0"),
        (lambda: GroupTargets(percentile=100), "percentile must be between 0 and 100"),
        (lambda: Targets(gpu_budget=-1), "gpu_budget must be 0 or more GPUs, not -1"),
        (lambda: Targets(groups={"encode": GroupTargets()}), "unknown group role 'encode'"),  # type: ignore[dict-item]
        (lambda: LoadThresholds(kv_usage_down=0.9, kv_usage_up=0.8), "need 0 <= kv_usage_down < kv_usage_up <= 1"),
        (lambda: Stability(scale_down_margin=1.0), "scale_down_margin must be in [0, 1)"),
        (lambda: Stability(max_step_down=0), "max_step_down must be 1 or more"),
        (lambda: Stability(noise_tolerance=-0.5), "noise_tolerance must be in [0, 3] standard errors"),
        (lambda: Stability(noise_tolerance=float("nan")), "noise_tolerance must be in [0, 3] standard errors"),
    ],
)
def test_settings_that_cannot_be_planned_with_are_refused_saying_which(
    build: Callable[[], object], message: str
) -> None:
    with pytest.raises(SettingsError) as raised:
        build()
    assert message in str(raised.value)
