"""The one exponential backoff every retry loop uses: doubling delays up to a cap, reset after a success,
optionally jittered."""

import pytest

from runtime.backoff import Backoff, exponential_delay


def test_the_delay_doubles_with_each_failure_in_a_row_up_to_its_cap() -> None:
    delays = [exponential_delay(attempt, first_s=0.5, max_s=10.0) for attempt in range(1, 8)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_no_failure_means_no_delay() -> None:
    assert exponential_delay(0, first_s=1.0, max_s=60.0) == 0.0
    assert exponential_delay(-3, first_s=1.0, max_s=60.0) == 0.0


def test_a_very_long_run_of_failures_waits_the_cap_instead_of_overflowing() -> None:
    assert exponential_delay(5000, first_s=1.0, max_s=60.0) == 60.0
    assert exponential_delay(1024, first_s=4.0, max_s=60.0) == 60.0


def test_a_cap_of_zero_means_no_delay_at_all() -> None:
    assert exponential_delay(3, first_s=1.0, max_s=0.0) == 0.0


def test_a_backoff_counts_its_failures_and_starts_again_after_a_reset() -> None:
    backoff = Backoff(0.1, 2.0)
    assert [backoff.next() for _ in range(7)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0])
    assert backoff.failures == 7
    backoff.reset()
    assert backoff.failures == 0
    assert backoff.next() == pytest.approx(0.1)


def test_jitter_takes_up_to_its_fraction_off_each_delay() -> None:
    draws = iter([0.0, 0.5, 0.999])
    backoff = Backoff(1.0, 10.0, jitter=0.5, uniform=lambda: next(draws))
    assert [backoff.next() for _ in range(3)] == pytest.approx([1.0, 2.0 * 0.75, 4.0 * (1 - 0.4995)])


def test_a_fresh_backoff_keeps_the_settings_but_not_the_failures() -> None:
    backoff = Backoff(0.5, 4.0, jitter=0.25, uniform=lambda: 0.0)
    backoff.next()
    backoff.next()
    fresh = backoff.fresh()
    assert (fresh.first_s, fresh.max_s, fresh.jitter, fresh.failures) == (0.5, 4.0, 0.25, 0)
    assert fresh.next() == 0.5


@pytest.mark.parametrize(
    ("first_s", "max_s", "jitter", "message"),
    [
        (-1.0, 2.0, 0.0, "0 <= first delay <= cap"),
        (3.0, 2.0, 0.0, "0 <= first delay <= cap"),
        (0.1, 2.0, 1.5, "jitter is a fraction of the delay from 0 to 1"),
    ],
)
def test_settings_that_make_no_sense_are_refused_with_what_is_wrong(
    first_s: float, max_s: float, jitter: float, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Backoff(first_s, max_s, jitter=jitter)
