"""A disaggregated pipeline's phases summed per worker group, for its page: what the prefill group computed and
what the decode group took, over the group's instances.

Each worker counts its part since it started (runtime/kv/phases.py, on its rank-0 ``WorkerLoad``): prompts it
computed for decode workers and their seconds from arrival to handoff, requests it took with a KV handoff and
their seconds from arrival to first token. The bridge keeps each instance's latest counters and, once per
interval, ``summarise`` compares them with those of the previous summary. Pure: no Django, no I/O.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PhaseCounts:
    """One worker's counters since it started (``WorkerLoad``'s four disaggregation fields)."""

    prefills: int = 0
    prefill_seconds: float = 0.0
    handoffs: int = 0
    handoff_first_token_seconds: float = 0.0

    def since(self, before: "PhaseCounts | None") -> "PhaseCounts":
        """What was counted after ``before``. A counter lower than before is a restarted worker, whose counters
        began again at 0: all it counted since is new (never a negative difference)."""
        if before is None or self.prefills < before.prefills or self.handoffs < before.handoffs:
            return self
        return PhaseCounts(
            self.prefills - before.prefills,
            max(self.prefill_seconds - before.prefill_seconds, 0.0),
            self.handoffs - before.handoffs,
            max(self.handoff_first_token_seconds - before.handoff_first_token_seconds, 0.0),
        )


def summarise(
    before: Mapping[int, PhaseCounts], now: Mapping[int, PhaseCounts], elapsed_s: float | None
) -> dict[str, Any]:
    """A group's phases, from each instance's counters now and at the previous summary (both by instance row id)
    ``elapsed_s`` seconds ago (None: there was none).

    Returns ``instances`` (how many report counters), ``prefills`` and ``handoffs`` (totals over them, since each
    worker started), and, over the interval: ``prefills_per_s`` and ``handoffs_per_s`` (when ``elapsed_s`` is
    known and positive), ``prefill_ms`` and ``handoff_first_token_ms`` (the mean over every request of the
    interval, whichever instance served it, so an instance that served many weighs as many; left out when none
    came). An instance absent from ``before`` counts all it has as new, as a restarted one does.
    """
    new = [counts.since(before.get(instance)) for instance, counts in now.items()]
    prefills, handoffs = sum(counts.prefills for counts in new), sum(counts.handoffs for counts in new)
    summary: dict[str, Any] = {
        "instances": len(now),
        "prefills": sum(counts.prefills for counts in now.values()),
        "handoffs": sum(counts.handoffs for counts in now.values()),
    }
    if elapsed_s is not None and elapsed_s > 0:
        summary["prefills_per_s"] = prefills / elapsed_s
        summary["handoffs_per_s"] = handoffs / elapsed_s
    if prefills:
        summary["prefill_ms"] = sum(counts.prefill_seconds for counts in new) / prefills * 1000
    if handoffs:
        summary["handoff_first_token_ms"] = sum(counts.handoff_first_token_seconds for counts in new) / handoffs * 1000
    return summary
