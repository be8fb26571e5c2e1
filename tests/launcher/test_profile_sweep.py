"""The pure parts of `flotilla profile`: what samples measure, scaling to engine time, which point a profile keeps."""

import json

import pytest

from launcher.profile_sweep import (
    Point,
    TimeScale,
    best_point,
    concurrency_levels,
    decode_point,
    decode_shape,
    percentile,
    prefill_point,
    profile_document,
    shortfall,
)
from planner.errors import ProfileError
from planner.profile import Profile


def point(concurrency: int, latency_s: float, tokens_per_s: float, phase: str = "prefill", length: int = 512) -> Point:
    return Point(phase, length, concurrency, concurrency * 4, latency_s, tokens_per_s)  # type: ignore[arg-type]


def test_the_best_point_is_the_fastest_of_those_within_the_target() -> None:
    points = [point(1, 0.05, 10_000), point(2, 0.09, 18_000), point(4, 0.2, 30_000), point(8, 0.6, 31_000)]
    assert best_point(points, 0.5) == points[2]


def test_a_point_exactly_at_the_target_meets_it() -> None:
    assert best_point([point(1, 0.5, 10_000)], 0.5) == point(1, 0.5, 10_000)


def test_a_faster_point_at_lower_concurrency_is_kept_over_a_slower_one_at_higher() -> None:
    # Past saturation throughput can fall while latency still meets the target: the most tokens/s wins.
    points = [point(4, 0.2, 30_000), point(8, 0.3, 28_000)]
    assert best_point(points, 0.5) == points[0]


def test_no_point_within_the_target_gives_none_and_a_shortfall_naming_the_closest() -> None:
    points = [point(1, 0.6, 10_000), point(2, 0.9, 18_000)]
    assert best_point(points, 0.5) is None
    missed = shortfall(points, "prefill", 512, 0.5)
    assert missed is not None and missed.closest == points[0]
    assert str(missed) == (
        "prefill at ISL 512: no concurrency met the TTFT target of 0.5 s; the best measured was TTFT 0.6 s at "
        "concurrency 1 (10,000 tokens/s)"
    )


def test_a_decode_shortfall_names_the_itl_and_the_context() -> None:
    missed = shortfall([point(1, 0.012, 80, "decode", 8192)], "decode", 8192, 0.01)
    assert str(missed).startswith("decode at context 8192: no concurrency met the ITL target of 0.01 s")


def test_a_length_with_a_point_within_target_has_no_shortfall() -> None:
    assert shortfall([point(1, 0.1, 10_000)], "prefill", 512, 0.5) is None


def test_wall_clock_durations_are_longer_and_rates_lower_in_the_time_of_a_sped_up_engine() -> None:
    # The mocker at speed-up 10 sleeps a tenth of each step's simulated time: a wall-clock TTFT of 5 ms is
    # 50 ms of its simulated time, and 20,000 tokens per wall second are 2,000 per simulated second.
    scale = TimeScale(10.0)
    assert scale.seconds(0.005) == pytest.approx(0.05)
    assert scale.rate(20_000) == pytest.approx(2_000)
    assert TimeScale().seconds(0.005) == 0.005 and TimeScale().rate(100.0) == 100.0


def test_a_prefill_point_is_the_percentile_ttft_and_the_prompt_tokens_over_the_run_in_engine_time() -> None:
    ttfts = [0.010, 0.011, 0.012, 0.020]
    measured = prefill_point(1000, 2, ttfts, 0.04, percent=90, scale=TimeScale(10))
    # 4 requests x 1000 tokens in 0.04 wall s = 100,000 per wall second = 10,000 per engine second.
    assert measured.tokens_per_s == pytest.approx(10_000)
    assert measured.latency_s == pytest.approx(percentile(ttfts, 90) * 10)
    assert (measured.requests, measured.concurrency, measured.length) == (4, 2, 1000)


def test_the_same_engine_work_measures_the_same_at_any_speed_up() -> None:
    # What speed-up 1 sees in 1 s, speed-up 20 sees in 0.05 s: equal points once scaled.
    slow = prefill_point(2048, 4, [0.2, 0.3, 0.4, 0.5], 1.0, percent=90, scale=TimeScale(1))
    fast = prefill_point(2048, 4, [0.01, 0.015, 0.02, 0.025], 0.05, percent=90, scale=TimeScale(20))
    assert fast.tokens_per_s == pytest.approx(slow.tokens_per_s)
    assert fast.latency_s == pytest.approx(slow.latency_s)


def test_percentile_interpolates_between_samples() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)
    assert percentile([7.0], 90) == 7.0
    assert percentile([], 90) == 0.0


def test_concurrency_doubles_up_to_the_maximum_which_is_always_measured() -> None:
    assert concurrency_levels(1) == [1]
    assert concurrency_levels(8) == [1, 2, 4, 8]
    assert concurrency_levels(48) == [1, 2, 4, 8, 16, 32, 48]


def test_decode_counts_only_the_window_in_which_every_request_decodes() -> None:
    # Two requests: A's first token at 0.0, B's at 1.0 (its prompt waited); A ends at 3.0, B at 4.0.
    # Window (1.0, 3.0]: A gives tokens at 2.0 and 3.0, B at 2.0 and 3.0, one per second each.
    a = [(0.0, 1), (1.0, 1), (2.0, 1), (3.0, 1)]
    b = [(1.0, 1), (2.0, 1), (3.0, 1), (4.0, 1)]
    measured = decode_point(1024, 2, [a, b], percent=90, scale=TimeScale(1))
    assert measured.tokens_per_s == pytest.approx(4 / 2.0)
    assert measured.latency_s == pytest.approx(1.0)


def test_a_gap_that_began_before_every_request_decoded_is_not_an_itl() -> None:
    # B's prompt step (0.5 s to 1.5 s) held A's next token back: that gap is a prefill's, not decode's ITL.
    a = [(0.0, 1), (1.5, 1), (1.6, 1), (1.7, 1), (1.8, 1)]
    b = [(1.5, 1), (1.6, 1), (1.7, 1), (1.8, 1), (1.9, 1)]
    measured = decode_point(1024, 2, [a, b], percent=100, scale=TimeScale(1))
    assert measured.latency_s == pytest.approx(0.1)
    assert measured.tokens_per_s == pytest.approx(6 / 0.3)


def test_an_output_of_several_tokens_counts_as_that_many_equal_gaps() -> None:
    # A reader a step behind gets two tokens at once, 20 ms after the last: two gaps of 10 ms, not one of 20.
    stream = [(0.0, 1), (0.010, 1), (0.030, 2), (0.040, 1)]
    measured = decode_point(1024, 1, [stream], percent=100, scale=TimeScale(1))
    assert measured.latency_s == pytest.approx(0.010)
    assert measured.tokens_per_s == pytest.approx(4 / 0.040)


def test_decode_without_a_common_window_counts_each_request_whole() -> None:
    # B's first token comes after A has finished: no moment when both decode.
    a = [(0.0, 1), (1.0, 1)]
    b = [(2.0, 1), (3.0, 1)]
    measured = decode_point(1024, 2, [a, b], percent=50, scale=TimeScale(1))
    assert measured.latency_s == pytest.approx(1.0)
    assert measured.tokens_per_s == pytest.approx(2 / 3.0)


def test_a_decode_request_has_the_context_on_average_while_it_decodes() -> None:
    prompt, output = decode_shape(4096, 256)
    assert (prompt, output) == (3968, 256) and prompt + output / 2 == 4096
    assert decode_shape(100, 256) == (50, 100)  # a short context keeps half of it for the prompt


def test_the_profile_document_is_one_the_planner_reads_back() -> None:
    document = profile_document(
        [point(8, 0.3, 46_000.04, length=2048), point(16, 0.2, 42_000, length=512)],
        [point(16, 0.007, 2_400.55, "decode", 1024)],
        ttft_target_s=0.5,
        itl_target_s=0.05,
        gpus_per_replica=1,
        model="m",
        engine="mocker",
        notes="n",
    )
    profile = Profile.from_json(json.dumps(document))
    assert profile.prefill.lengths == (512.0, 2048.0) and profile.prefill.tokens_per_s == (42_000.0, 46_000.0)
    assert profile.decode.target_s == 0.05 and profile.decode.tokens_per_s == (2_400.6,)
    assert (profile.gpus_per_replica, document["model"], document["engine"]) == (1, "m", "mocker")


def test_a_profile_without_a_point_in_a_phase_is_refused_as_the_planner_would() -> None:
    with pytest.raises(ProfileError, match=r"decode\.points: must have at least one point"):
        profile_document(
            [point(1, 0.1, 1000)],
            [],
            ttft_target_s=0.5,
            itl_target_s=0.05,
            gpus_per_replica=1,
            model="m",
            engine="mocker",
            notes="",
        )
