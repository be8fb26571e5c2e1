"""Exponential backoff: how long a retry loop waits before its next try.

A loop that retries something that may be down for a while (etcd, the control plane, a crashed task or
process) waits twice as long after each failure in a row, up to a cap: a short outage is retried at once, a
long one is not hammered. ``exponential_delay`` gives the delay for a loop that counts its failures itself
(restart policies, the reconciler); a ``Backoff`` counts them for a loop that only knows it failed again.
"""

import random
from collections.abc import Callable

# 2.0 ** 1024 overflows a float; any cap was passed long before that many doublings.
_MAX_DOUBLINGS = 1023


def exponential_delay(attempt: int, *, first_s: float, max_s: float) -> float:
    """The delay before retry number ``attempt`` of a run of failures (1: the first retry): ``first_s``
    doubled ``attempt - 1`` times, at most ``max_s``; 0 when nothing failed (``attempt`` 0 or less)."""
    if attempt <= 0:
        return 0.0
    doublings = attempt - 1
    if doublings > _MAX_DOUBLINGS:
        return max_s
    return min(max_s, first_s * 2.0**doublings)


class Backoff:
    """The delays of one retry loop: ``next()`` after each failure (``first_s``, then doubled up to
    ``max_s``), ``reset()`` after a success to start again from ``first_s``.

    ``jitter`` (0 to 1) takes up to that fraction off each delay at random, so that many clients that
    failed at the same moment (every agent, when the control plane restarts) do not all retry in step.
    ``uniform`` draws the random fraction, in [0, 1) (tests pass a fixed one). Raises ValueError for a
    negative delay, a cap under the first delay, or a jitter outside 0 to 1."""

    def __init__(
        self,
        first_s: float,
        max_s: float,
        *,
        jitter: float = 0.0,
        uniform: Callable[[], float] = random.random,
    ) -> None:
        if first_s < 0 or max_s < first_s:
            raise ValueError(f"a backoff needs 0 <= first delay <= cap, got first {first_s} s and cap {max_s} s")
        if not 0.0 <= jitter <= 1.0:
            raise ValueError(f"a backoff's jitter is a fraction of the delay from 0 to 1, got {jitter}")
        self.first_s = first_s
        self.max_s = max_s
        self.jitter = jitter
        self._uniform = uniform
        #: Failures since the start or the last ``reset()``.
        self.failures = 0

    def next(self) -> float:
        """Count one more failure; returns the seconds to wait before trying again."""
        self.failures += 1
        delay = exponential_delay(self.failures, first_s=self.first_s, max_s=self.max_s)
        return delay * (1.0 - self.jitter * self._uniform())

    def reset(self) -> None:
        """The last try succeeded: the next failure waits ``first_s`` again."""
        self.failures = 0

    def fresh(self) -> "Backoff":
        """A new backoff with these settings and no failures (one per retry loop that shares them)."""
        return Backoff(self.first_s, self.max_s, jitter=self.jitter, uniform=self._uniform)
