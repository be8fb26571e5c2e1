"""Targets as the control plane stores them: JSON in and out, each problem named by its path."""

import pytest

from planner import GroupTargets, SettingsError, Targets
from planner.targets_json import targets_from_dict, targets_to_dict


def test_a_document_reads_back_to_equal_targets() -> None:
    targets = targets_from_dict(
        {"default": {"ttft_s": 0.5, "itl_s": 0.05}, "groups": {"prefill": {"max_replicas": 3}}, "gpu_budget": 4}
    )
    assert targets_from_dict(targets_to_dict(targets)) == targets


def test_a_group_entry_is_laid_over_the_pipeline_targets() -> None:
    targets = targets_from_dict({"default": {"ttft_s": 0.5}, "groups": {"prefill": {"max_replicas": 3}}})
    assert targets.for_group("prefill") == GroupTargets(ttft_s=0.5, max_replicas=3)


def test_an_empty_document_is_the_defaults() -> None:
    assert targets_from_dict({}) == Targets()


@pytest.mark.parametrize(
    ("document", "field"),
    [
        ({"default": {"ttft_s": -1}}, "default.ttft_s"),
        ({"groups": {"prefill": {"ttft_s": "fast"}}}, "groups.prefill.ttft_s"),
        ({"groups": {"encode": {}}}, "groups.encode"),
        ({"stability": {"max_step_down": 1.5}}, "stability.max_step_down"),
        ({"stability": {"cooldown_s": -1}}, "stability.cooldown_s"),
        ({"load": {"kv_usage_up": 0.1}}, "load.kv_usage_down"),
        ({"enabled": 1}, "enabled"),
        ({"gpu_budget": -2}, "gpu_budget"),
        ({"default": {"ttft": 1}}, "default.ttft"),
        ({"predictor": "arima"}, "predictor"),
        ({"default": {"max_replicas": None}}, "default.max_replicas"),
        ([], ""),
    ],
)
def test_a_setting_that_cannot_be_planned_with_names_its_path(document: object, field: str) -> None:
    with pytest.raises(SettingsError) as raised:
        targets_from_dict(document)
    assert raised.value.field == field
