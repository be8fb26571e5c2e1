"""TensorRT-LLM's iteration stats as Flotilla's load reports (engines/trtllm/stats.py), on dicts shaped as
``LLM.get_stats_async`` yields them (the fields Dynamo's TensorRT-LLM publisher reads)."""

from pathlib import Path
from typing import Any

import pytest

from engines.shared.gpu_engine_args import GpuPlacement
from engines.trtllm.engine import TrtLlmEngine, llm_kwargs
from engines.trtllm.stats import StatsToLoad
from runtime.kv.events import WorkerLoad


def stat(
    *,
    active: int = 3,
    queued: int = 2,
    paused: int = 1,
    used: int = 40,
    total: int = 100,
    reused: int = 0,
    missed: int = 0,
) -> dict[str, Any]:
    return {
        "iter": 7,
        "numActiveRequests": active,
        "numQueuedRequests": queued,
        "maxNumActiveRequests": 64,
        "inflightBatchingStats": {"numPausedRequests": paused, "numCtxTokens": 0},
        "kvCacheStats": {
            "maxNumBlocks": total,
            "usedNumBlocks": used,
            "freeNumBlocks": total - used,
            "reusedBlocks": reused,
            "missedBlocks": missed,
        },
    }


def test_an_iterations_stats_become_the_ranks_load() -> None:
    load = StatsToLoad().update(stat())
    assert load == WorkerLoad(
        instance_id=0,
        active_requests=6,
        running=3,
        waiting=3,
        kv_active_blocks=40,
        kv_total_blocks=100,
        kv_usage=0.4,
        prefix_hit_rate=None,
    )


def test_the_prefix_hit_rate_is_of_the_blocks_looked_up_since_the_previous_report() -> None:
    stats = StatsToLoad()
    assert stats.update(stat(reused=10, missed=30)).prefix_hit_rate == pytest.approx(0.25)
    assert stats.update(stat(reused=19, missed=31)).prefix_hit_rate == pytest.approx(0.9)
    assert stats.update(stat(reused=19, missed=31)).prefix_hit_rate is None  # nothing looked up meanwhile


def test_each_attention_dp_rank_has_its_own_load() -> None:
    stats = StatsToLoad()
    stats.update(stat(used=10))
    stats.update({**stat(used=20), "attentionDpRank": 1})
    assert {rank: load.kv_active_blocks for rank, load in stats.loads.items()} == {0: 10, 1: 20}


def test_iteration_stats_are_on_unless_the_extra_arguments_turn_them_off() -> None:
    assert llm_kwargs(Path("/m"), GpuPlacement(), {})["enable_iter_perf_stats"] is True
    assert llm_kwargs(Path("/m"), GpuPlacement(), {"enable_iter_perf_stats": False})["enable_iter_perf_stats"] is False


def test_the_engines_load_comes_from_the_latest_stats_and_before_them_from_its_requests() -> None:
    engine = TrtLlmEngine(Path("/m"), GpuPlacement(), {})
    assert engine.load() == [WorkerLoad(instance_id=0, active_requests=0)]
    engine._on_stats(stat(used=5))
    engine._on_stats(stat(used=6))
    (load,) = engine.load()
    assert (load.kv_active_blocks, load.running, load.waiting) == (6, 3, 3)
