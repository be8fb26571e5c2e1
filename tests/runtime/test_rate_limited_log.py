"""The one rate-limited warning: the first line at once, then at most one per period counting the rest, the
rest optionally at a lower level."""

import logging

import pytest

from runtime.rate_limited_log import RateLimitedLog


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def logger(caplog: pytest.LogCaptureFixture) -> logging.Logger:
    caplog.set_level(logging.DEBUG, logger="tests.rate_limited")
    return logging.getLogger("tests.rate_limited")


def _lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(record.levelno, record.getMessage()) for record in caplog.records]


def test_the_first_line_goes_out_at_once_and_the_next_one_counts_those_held_back(
    logger: logging.Logger, caplog: pytest.LogCaptureFixture
) -> None:
    clock = _Clock()
    warnings = RateLimitedLog(logger, period_s=10.0, clock=clock)
    assert warnings.warning("etcd is down")
    clock.now += 4
    assert not warnings.warning("etcd is down")
    assert not warnings.warning("etcd is down")
    clock.now += 6
    assert warnings.warning("etcd is still down")
    assert _lines(caplog) == [
        (logging.WARNING, "etcd is down"),
        (logging.WARNING, "etcd is still down (and 2 more like it since the last such line)"),
    ]
    assert warnings.count == 4


def test_lines_held_back_are_dropped_unless_a_level_is_given_for_them(
    logger: logging.Logger, caplog: pytest.LogCaptureFixture
) -> None:
    warnings = RateLimitedLog(logger, period_s=10.0, held_level=logging.DEBUG, clock=_Clock())
    warnings.warning("a push failed: ConnectionError")
    warnings.warning("a push failed: TimeoutError")
    assert _lines(caplog) == [
        (logging.WARNING, "a push failed: ConnectionError"),
        (logging.DEBUG, "a push failed: TimeoutError"),
    ]


def test_due_says_whether_a_line_now_would_go_out_without_counting_one(logger: logging.Logger) -> None:
    clock = _Clock()
    warnings = RateLimitedLog(logger, period_s=10.0, clock=clock)
    assert warnings.due()
    warnings.warning("the loop ran 2.0 s late")
    assert not warnings.due()
    clock.now += 10
    assert warnings.due()
    assert warnings.count == 1
