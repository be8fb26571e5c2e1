"""The node's CPU utilisation: the share of all CPUs' time that was busy between two readings of ``/proc/stat``.

The kernel counts, since boot, the time all CPUs together spent in each state (the first line, ``cpu  user nice
system idle iowait irq softirq steal guest guest_nice``, in clock ticks). Busy is everything but ``idle`` and
``iowait`` (a CPU waiting for a disk is free to run something else); the share is taken over the ticks that passed
between two readings, so the first reading has no figure. ``guest`` and ``guest_nice`` are left out of the total:
the kernel counts them in ``user`` and ``nice`` already (as ``top`` and ``procps`` do).

A machine without ``/proc/stat`` (not Linux), or one the agent cannot read or parse, has no figure: the reason is
logged once, and the heartbeats go on without it.
"""

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PROC_STAT = Path("/proc/stat")
# user nice system idle iowait irq softirq steal: the states the total is summed over.
_COUNTED = 8
_IDLE, _IOWAIT = 3, 4


@dataclass(frozen=True)
class CpuTimes:
    """All CPUs' time since boot, in clock ticks: ``total`` and the part of it that was ``busy``."""

    busy: int
    total: int


def parse_cpu_times(text: str) -> CpuTimes:
    """The aggregate ``cpu`` line of ``/proc/stat`` text. Raises ValueError, saying why, when there is none.

    Kernels before 2.6.11 print fewer than eight fields: the missing states count as 0.
    """
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            try:
                ticks = [int(field) for field in fields[1 : 1 + _COUNTED]]
            except ValueError:
                raise ValueError(f"the cpu line of /proc/stat holds a field that is not a count: {line!r}") from None
            if len(ticks) <= _IDLE:
                raise ValueError(f"the cpu line of /proc/stat has too few fields: {line!r}")
            ticks += [0] * (_COUNTED - len(ticks))
            total = sum(ticks)
            return CpuTimes(busy=total - ticks[_IDLE] - ticks[_IOWAIT], total=total)
    raise ValueError("/proc/stat has no aggregate cpu line")


def utilization_percent(before: CpuTimes, after: CpuTimes) -> float | None:
    """The percentage of the ticks between ``before`` and ``after`` that were busy, 0..100 (one decimal); None
    when no tick passed or the counters went back (a reboot between the readings)."""
    total = after.total - before.total
    if total <= 0:
        return None
    # iowait may go backwards on some kernels (proc(5)): the busy ticks are kept within what passed.
    busy = min(max(after.busy - before.busy, 0), total)
    return round(100.0 * busy / total, 1)


class CpuMeter:
    """Reads ``/proc/stat`` (``path``) at each ``read()`` and gives the utilisation since the previous one."""

    def __init__(self, path: Path = PROC_STAT) -> None:
        self._path = path
        self._previous: CpuTimes | None = None
        self._unreadable_logged = False
        # Reads run in worker threads (asyncio.to_thread): two at once must not both take the same previous one.
        self._lock = threading.Lock()

    def read(self) -> float | None:
        """The CPU utilisation in percent since the last call; None on the first call, and when the file cannot be
        read or parsed (logged once)."""
        with self._lock:
            return self._read()

    def _read(self) -> float | None:
        try:
            now = parse_cpu_times(self._path.read_text())
        except (OSError, ValueError) as exc:
            if not self._unreadable_logged:
                self._unreadable_logged = True
                # No /proc/stat is expected off Linux; an unreadable or strange one is not.
                level = logging.INFO if isinstance(exc, FileNotFoundError) else logging.WARNING
                log.log(level, "cannot read the CPU utilisation from %s (%s): reporting none", self._path, exc)
            self._previous = None  # a later reading starts afresh, not from a stale one
            return None
        previous, self._previous = self._previous, now
        return None if previous is None else utilization_percent(previous, now)
