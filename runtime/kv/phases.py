"""A worker's part in disaggregated serving, counted: prompts it computed for a decode worker, requests it took
with a prefill worker's KV handoff, and how long each took, added to its load reports (runtime/kv/events.py
``WorkerLoad``) for the dashboard to show per instance and group."""

import time

import msgspec

from runtime.kv.events import WorkerLoad
from runtime.kv.load_metrics import LoadReports


class PhaseCounters:
    """Counters since the worker started; ``prefilled`` and ``took_handoff`` are called by its request handler."""

    __slots__ = ("handoff_first_token_seconds", "handoffs", "prefill_seconds", "prefills")

    def __init__(self) -> None:
        self.prefills = 0
        self.prefill_seconds = 0.0
        self.handoffs = 0
        self.handoff_first_token_seconds = 0.0

    def prefilled(self, seconds: float) -> None:
        """A prefill-only request ended with its handoff, ``seconds`` after it arrived."""
        self.prefills += 1
        self.prefill_seconds += seconds

    def took_handoff(self, seconds: float) -> None:
        """A request that came with a handoff gave its first output ``seconds`` after it arrived."""
        self.handoffs += 1
        self.handoff_first_token_seconds += seconds

    def reports(self, reports: LoadReports) -> LoadReports:
        """``reports`` with these counters on rank 0's (none added while the worker has served no such request)."""

        def with_phases() -> list[WorkerLoad]:
            loads = reports()
            if not (self.prefills or self.handoffs) or not loads:
                return loads
            first = msgspec.structs.replace(
                loads[0],
                prefills=self.prefills,
                prefill_seconds=self.prefill_seconds,
                handoffs=self.handoffs,
                handoff_first_token_seconds=self.handoff_first_token_seconds,
            )
            return [first, *loads[1:]]

        return with_phases


def now() -> float:
    """The clock the counters' seconds are read on."""
    return time.monotonic()
