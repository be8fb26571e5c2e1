"""TensorRT-LLM's iteration stats, as Flotilla's load reports.

With ``enable_iter_perf_stats`` the ``LLM`` keeps one stats dict per executor iteration, read with
``get_stats_async(timeout)``; the fields used here are those Dynamo's TensorRT-LLM publisher reads::

    {"iter": int, "numActiveRequests": int, "numQueuedRequests": int, "maxNumActiveRequests": int,
     "attentionDpRank": int (with attention DP),
     "inflightBatchingStats": {"numPausedRequests": int, ...},
     "kvCacheStats": {"maxNumBlocks": int, "usedNumBlocks": int, "freeNumBlocks": int,
                      "reusedBlocks": int, "missedBlocks": int, ...}}

``reusedBlocks`` and ``missedBlocks`` count since the start, so the prefix hit rate of a period is taken from
their growth between two reports.
"""

from typing import Any

from runtime.kv.events import WorkerLoad


class StatsToLoad:
    """Turns each rank's latest stats into a WorkerLoad, remembering the block counters of its previous one."""

    def __init__(self) -> None:
        self._previous: dict[int, tuple[int, int]] = {}  # rank -> (reusedBlocks, missedBlocks)
        self.loads: dict[int, WorkerLoad] = {}

    def update(self, stat: dict[str, Any]) -> WorkerLoad:
        """Record ``stat`` (one iteration's dict) as its rank's load, and return it."""
        rank = int(stat.get("attentionDpRank") or 0)
        kv = stat.get("kvCacheStats") or {}
        running = int(stat.get("numActiveRequests", 0))
        paused = int((stat.get("inflightBatchingStats") or {}).get("numPausedRequests", 0))
        waiting = int(stat.get("numQueuedRequests", 0)) + paused
        used, total = kv.get("usedNumBlocks"), kv.get("maxNumBlocks")
        load = WorkerLoad(
            instance_id=0,
            dp_rank=rank,
            active_requests=running + waiting,
            running=running,
            waiting=waiting,
            kv_active_blocks=used,
            kv_total_blocks=total,
            kv_usage=used / total if used is not None and total else None,
            prefix_hit_rate=self._hit_rate(rank, kv),
        )
        self.loads[rank] = load
        return load

    def _hit_rate(self, rank: int, kv: dict[str, Any]) -> float | None:
        if "reusedBlocks" not in kv or "missedBlocks" not in kv:
            return None
        counts = (int(kv["reusedBlocks"]), int(kv["missedBlocks"]))
        previous = self._previous.get(rank, (0, 0))
        self._previous[rank] = counts
        reused, missed = counts[0] - previous[0], counts[1] - previous[1]
        if reused < 0 or missed < 0:  # counters restarted
            reused, missed = counts
        looked_up = reused + missed
        return reused / looked_up if looked_up > 0 else None
