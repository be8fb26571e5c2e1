"""When ``flotilla up`` restarts a part that ended, and when it gives up on it: systemd's ``Restart=`` with a
growing ``RestartSec=``, and ``StartLimitBurst=`` within ``StartLimitIntervalSec=``.

The decision is pure (``RestartHistory.ended(now)``); ``launcher.stack.up`` acts on it.
"""

import signal
from collections import deque
from dataclasses import dataclass

from runtime.backoff import exponential_delay

#: Exit code 2 is a refused command line or configuration (argparse, click, Go's flag package, ``flotilla``'s own
#: EXIT_CONFIG): the same command would be refused again.
EXIT_USAGE = 2


@dataclass(frozen=True)
class RestartPolicy:
    """Up to ``burst`` restarts of one part within ``window_s`` seconds, each after a delay that doubles from
    ``first_delay_s`` up to ``max_delay_s``; the next end within the window is one too many. A part off the serving
    path that was given up on is started again ``retry_given_up_s`` seconds later (``launcher/stack/parts.py``)."""

    burst: int = 5
    window_s: float = 120.0
    first_delay_s: float = 1.0
    max_delay_s: float = 30.0
    retry_given_up_s: float = 300.0


@dataclass(frozen=True)
class Restart:
    """Start the part again after ``delay_s`` seconds: its restart number ``number`` within the window."""

    delay_s: float
    number: int


@dataclass(frozen=True)
class GiveUp:
    """Restart it no more: it ended ``ends`` times within the window (``refused``: it refused its configuration)."""

    ends: int
    refused: bool = False

    def why(self, policy: RestartPolicy) -> str:
        """Why, in words that follow how the part ended."""
        if self.refused:
            return (
                "which says its command line or configuration was refused: restarting it cannot help until that "
                "is fixed"
            )
        if policy.burst == 0:
            return "and restarts are off (--restart-burst 0)"
        return f"its {_ordinal(self.ends)} end within {policy.window_s:.0f} s: it keeps failing"


class RestartHistory:
    """The recent ends of one part, and what to do about the latest."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._ends: deque[float] = deque()

    def ended(self, now: float, code: int) -> Restart | GiveUp:
        """Record an end at ``now`` (monotonic seconds) with exit ``code``; returns whether and when to restart."""
        policy = self.policy
        while self._ends and self._ends[0] <= now - policy.window_s:
            self._ends.popleft()
        self._ends.append(now)
        ends = len(self._ends)
        if code == EXIT_USAGE:
            return GiveUp(ends, refused=True)
        if ends > policy.burst:
            return GiveUp(ends)
        # A part that stayed up for a whole window starts again from the first delay.
        delay_s = exponential_delay(ends, first_s=policy.first_delay_s, max_s=policy.max_delay_s)
        return Restart(delay_s=delay_s, number=ends)


def describe_end(code: int) -> str:
    """How a process ended, from its exit code (negative: the signal that killed it): "was killed by signal 9
    (SIGKILL)", "exited with code 1"."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by signal {-code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"was killed by signal {-code}"


def _ordinal(number: int) -> str:
    suffix = "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"
