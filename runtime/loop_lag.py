"""Says when this process's event loop falls behind: every stream it serves is late by as much.

A loop that wakes a timer a second late is overloaded (or something blocks it); the warning names
the lag so that slow streams, late heartbeats and expiring etcd leases can be traced to their cause.
"""

import asyncio
import logging
import time

from runtime.rate_limited_log import RateLimitedLog

log = logging.getLogger(__name__)

# How often the loop is sampled, and the lag worth a warning.
SAMPLE_S = 0.25
WARN_LAG_S = 1.0
# Warnings at most this often; the worst lag since the last one is reported.
REPORT_EVERY_S = 10.0


async def watch_loop_lag() -> None:
    """Sample the event loop's lag for ever, warning (rate-limited) when it exceeds WARN_LAG_S."""
    warnings = RateLimitedLog(log, period_s=REPORT_EVERY_S)
    worst = 0.0
    while True:
        before = time.monotonic()
        await asyncio.sleep(SAMPLE_S)
        worst = max(worst, time.monotonic() - before - SAMPLE_S)
        if worst > WARN_LAG_S and warnings.due():
            warnings.warning(f"this process's event loop ran up to {worst:.1f} s late: it is overloaded or blocked")
            worst = 0.0
