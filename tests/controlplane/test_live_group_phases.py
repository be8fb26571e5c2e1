"""controlplane.live.group_phases: a disaggregated pipeline's phases summed per worker group from its instances'
counters, with rates and count-weighted means over the interval between two summaries."""

import pytest

from controlplane.live.group_phases import PhaseCounts, summarise


def prefilled(count: int, seconds: float) -> PhaseCounts:
    return PhaseCounts(prefills=count, prefill_seconds=seconds)


def took(count: int, seconds: float) -> PhaseCounts:
    return PhaseCounts(handoffs=count, handoff_first_token_seconds=seconds)


def test_totals_are_summed_over_the_groups_instances() -> None:
    summary = summarise({}, {1: prefilled(4, 0.2), 2: prefilled(6, 0.3)}, None)
    assert (summary["instances"], summary["prefills"], summary["handoffs"]) == (2, 10, 0)


def test_the_mean_of_the_interval_is_weighted_by_how_many_each_instance_served() -> None:
    before = {1: prefilled(10, 1.0), 2: prefilled(10, 1.0)}
    # One prompt of 100 ms on instance 1, three of 20 ms on instance 2: 160 ms over 4, not (100 + 20) / 2.
    now = {1: prefilled(11, 1.1), 2: prefilled(13, 1.06)}
    summary = summarise(before, now, 2.0)
    assert summary["prefill_ms"] == pytest.approx(40.0)
    assert summary["prefills_per_s"] == pytest.approx(2.0)  # 4 in 2 s
    assert summary["prefills"] == 24


def test_a_decode_groups_handoffs_have_their_rate_and_mean_first_token() -> None:
    summary = summarise({7: took(5, 0.05)}, {7: took(8, 0.08), 8: took(1, 0.03)}, 1.0)
    # Instance 8 is new: its one handoff counts as this interval's.
    assert summary["handoffs"] == 9
    assert summary["handoffs_per_s"] == pytest.approx(4.0)
    assert summary["handoff_first_token_ms"] == pytest.approx(15.0)  # (30 + 30) ms over 4
    assert "prefill_ms" not in summary and summary["prefills_per_s"] == 0


def test_a_restarted_worker_counts_from_zero_and_never_subtracts() -> None:
    before = {1: prefilled(100, 5.0), 2: prefilled(3, 0.3)}
    # Instance 1 restarted: its counters began again, 2 prompts of 25 ms since.
    now = {1: prefilled(2, 0.05), 2: prefilled(5, 0.35)}
    summary = summarise(before, now, 1.0)
    assert summary["prefills_per_s"] == pytest.approx(4.0)  # 2 + 2, not -98 + 2
    assert summary["prefill_ms"] == pytest.approx(25.0)  # (50 + 50) ms over 4
    assert summary["prefills"] == 7  # what its workers count now


def test_an_interval_without_requests_has_a_zero_rate_and_no_mean() -> None:
    counts = {1: prefilled(4, 0.2)}
    summary = summarise(counts, counts, 1.0)
    assert summary["prefills_per_s"] == 0
    assert "prefill_ms" not in summary and "handoff_first_token_ms" not in summary


def test_the_first_summary_has_no_rate_but_the_mean_since_the_workers_started() -> None:
    summary = summarise({}, {1: prefilled(4, 0.2)}, None)
    assert "prefills_per_s" not in summary
    assert summary["prefill_ms"] == pytest.approx(50.0)


def test_a_seconds_counter_that_went_down_alone_adds_no_negative_time() -> None:
    # Not a restart the counts show (a float summed in another order, say): nothing is subtracted.
    summary = summarise({1: prefilled(4, 0.2)}, {1: prefilled(5, 0.19)}, 1.0)
    assert summary["prefill_ms"] == 0.0
