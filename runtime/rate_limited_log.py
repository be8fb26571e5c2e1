"""A warning that a loop may hit on every turn, logged at most once per period with a count of the rest.

A reconciler pass every 2 s, or a router reading malformed events by the thousand, would otherwise bury
the log under one line repeated; the first line goes out at once, so nothing is said late.
"""

import logging
import math
import time
from collections.abc import Callable


class RateLimitedLog:
    """Logs through ``logger`` at most one message per ``period_s`` seconds; ``count`` counts them all.

    The messages held back are counted in the next line that goes out; with ``held_level`` (say
    ``logging.DEBUG``) each is also logged at that level, for whoever needs every one."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        period_s: float,
        held_level: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._period_s = period_s
        self._held_level = held_level
        self._clock = clock
        self._held = 0
        self._last = -math.inf
        self.count = 0

    def due(self) -> bool:
        """Whether a message now would be logged (for a caller that gathers what to say until it is)."""
        return self._clock() - self._last >= self._period_s

    def warning(self, message: str) -> bool:
        """Log ``message`` unless one went out less than a period ago; returns whether it was logged."""
        self.count += 1
        now = self._clock()
        if now - self._last < self._period_s:
            self._held += 1
            if self._held_level is not None:
                self._logger.log(self._held_level, "%s", message)
            return False
        more = f" (and {self._held} more like it since the last such line)" if self._held else ""
        self._logger.warning("%s%s", message, more)
        self._held, self._last = 0, now
        return True
