"""Profiles: JSON in and out, interpolation, and validation errors that name their field."""

import json

import pytest

from planner import Profile, ProfileError
from tests.planner.factories import FLAT_PROFILE

TWO_POINTS = {
    "version": 1,
    "gpus_per_replica": 2,
    "prefill": {"ttft_s": 0.5, "points": [{"isl": 1000, "tokens_per_s": 20000}, {"isl": 3000, "tokens_per_s": 10000}]},
    "decode": {
        "itl_s": 0.05,
        "points": [{"context_tokens": 1024, "tokens_per_s": 4000}, {"context_tokens": 8192, "tokens_per_s": 2000.5}],
    },
}


def problems(data: object) -> list[tuple[str, str]]:
    with pytest.raises(ProfileError) as raised:
        Profile.from_dict(data)
    return raised.value.problems


def test_a_profile_round_trips_through_json() -> None:
    profile = Profile.from_json(json.dumps(TWO_POINTS))
    assert profile.gpus_per_replica == 2
    assert Profile.from_json(profile.to_json()) == profile
    assert json.loads(profile.to_json()) == TWO_POINTS


def test_capacity_is_interpolated_between_points_and_held_outside_them() -> None:
    curve = Profile.from_dict(TWO_POINTS).prefill
    assert curve.at(2000) == 15000
    assert (curve.at(10), curve.at(99999)) == (20000, 10000)
    assert curve.covers(1000) and not curve.covers(3001)
    assert Profile.from_dict(FLAT_PROFILE).decode.at(5000) == 1000


def test_every_problem_is_reported_with_its_field_path() -> None:
    data = {
        "version": 1,
        "prefill": {"ttft_s": -1, "points": [{"isl": 1000, "tokens_per_s": "fast"}, {"isl": 2000}]},
        "decode": {"itl_s": 0.05, "points": [{"context_tokens": 0, "tokens_per_s": 100}]},
    }
    assert problems(data) == [
        ("prefill.ttft_s", "must be a positive number of seconds, not -1"),
        ("prefill.points[0].tokens_per_s", "must be a positive number, not 'fast'"),
        ("prefill.points[1].tokens_per_s", "missing"),
        ("decode.points[0].context_tokens", "must be a positive number, not 0"),
    ]
    with pytest.raises(ProfileError, match=r"^prefill\.ttft_s: must be a positive number of seconds, not -1; "):
        Profile.from_dict(data)


def test_lengths_must_increase_from_point_to_point() -> None:
    data = json.loads(json.dumps(TWO_POINTS))
    data["decode"]["points"][1]["context_tokens"] = 1024
    assert problems(data) == [("decode.points[1].context_tokens", "must be greater than the previous point's (1024)")]


def test_missing_sections_and_empty_points_are_named() -> None:
    assert problems({"prefill": {"ttft_s": 0.5, "points": []}}) == [
        ("prefill.points", "must have at least one point"),
        ("decode", "missing"),
    ]
    assert problems({"prefill": {"points": "many"}, "decode": []}) == [
        ("prefill.ttft_s", "missing"),
        ("prefill.points", "must be a list"),
        ("decode", "must be an object"),
    ]


def test_unknown_fields_are_refused_by_name() -> None:
    data = json.loads(json.dumps(TWO_POINTS))
    data["decode"]["points"][0]["itl_s"] = 0.04
    data["colour"] = "blue"
    found = problems(data)
    assert [path for path, _ in found] == ["colour", "decode.points[0].itl_s"]
    assert found[1][1] == "unknown field (expected one of context_tokens, tokens_per_s)"


def test_a_boolean_is_not_a_number_and_a_version_must_be_known() -> None:
    data = json.loads(json.dumps(TWO_POINTS))
    data["version"] = 2
    data["gpus_per_replica"] = True
    data["prefill"]["points"][0]["isl"] = True
    assert problems(data) == [
        ("version", "must be 1, not 2"),
        ("gpus_per_replica", "must be a whole number of GPUs, 0 or more, not True"),
        ("prefill.points[0].isl", "must be a positive number, not True"),
    ]


def test_text_that_is_not_json_says_where() -> None:
    with pytest.raises(ProfileError, match="not JSON: Expecting ',' delimiter at line 1 column 15"):
        Profile.from_json('{"version": 1 "prefill": {}}')
    with pytest.raises(ProfileError, match=r"^must be an object$"):
        Profile.from_json("[1, 2]")
