"""SGLang's hierarchical cache through out=sglang: its ServerArgs pass through, its host and storage tiers'
events are tracked, and the worker reports each tier's pages and the host pool's size (engines/sglang/hicache.py).

SGLang does not import without a CUDA build of torch: the engine here is a stand-in with the shapes SGLang
documents (its load snapshot reader, its ZMQ event batches with a trailing medium)."""

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from engines.sglang.engine import SglangEngine, engine_kwargs, parse_engine_args
from engines.sglang.hicache import hicache_tiers, host_total_blocks
from engines.shared.gpu_engine_args import GpuPlacement
from runtime.kv.events import TierLoad

TOKENS = list(range(50, 82))  # two pages of 16
HICACHE = {"page_size": 16, "enable_hierarchical_cache": True, "hicache_ratio": 3.0}


class LoadSnapshot(msgspec.Struct, kw_only=True):
    """The fields Flotilla reads of SGLang's ``LoadSnapshot`` (it has none about the host cache)."""

    dp_rank: int = 0
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_used_tokens: int = 0
    max_total_num_tokens: int = 0
    token_usage: float = 0.0
    cache_hit_rate: float = 0.0


def engine_with(args: dict[str, Any], snapshots: list[LoadSnapshot]) -> SglangEngine:
    engine = SglangEngine(Path("/m"), GpuPlacement(), args)
    reader = SimpleNamespace(read_all=lambda: snapshots)
    engine._engine = SimpleNamespace(tokenizer_manager=SimpleNamespace(load_snapshot_reader=reader))
    return engine


def test_the_hierarchical_cache_arguments_pass_through_to_sglang() -> None:
    raw = (
        '{"enable_hierarchical_cache": true, "hicache_ratio": 2.5, "hicache_size": 0, "hicache_write_policy": '
        '"write_through", "hicache_io_backend": "kernel", "hicache_mem_layout": "page_first", '
        '"hicache_storage_backend": "file", "hicache_storage_prefetch_policy": "best_effort", '
        '"hicache_storage_backend_extra_config": "{}"}'
    )
    args = parse_engine_args(raw)
    kwargs = engine_kwargs(Path("/m"), GpuPlacement(), args, kv_events_endpoint=None)
    assert {key: kwargs[key] for key in args} == args


def test_the_tiers_a_worker_offloads_to_follow_its_arguments() -> None:
    assert hicache_tiers({}) == ()
    assert hicache_tiers({"enable_hierarchical_cache": True}) == ("cpu",)
    assert hicache_tiers({"enable_hierarchical_cache": True, "hicache_storage_backend": "mooncake"}) == ("cpu", "disk")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ({"enable_hierarchical_cache": True}, 2000),  # SGLang's default ratio, 2
        ({"enable_hierarchical_cache": True, "hicache_ratio": 3.0}, 3000),
        ({"enable_hierarchical_cache": True, "hicache_size": 64}, None),  # GB: its pages depend on the model
        ({}, None),
    ],
)
def test_the_host_pool_is_the_ratio_times_the_device_pool_unless_sized_in_gb(
    args: dict[str, Any], expected: int | None
) -> None:
    assert host_total_blocks(args, device_tokens=16000, page_size=16) == expected


def test_the_worker_reports_the_host_tiers_pages_from_the_events_and_its_size_from_the_ratio() -> None:
    engine = engine_with(HICACHE, [LoadSnapshot(max_total_num_tokens=1600, num_used_tokens=32, token_usage=0.02)])
    batch = [
        0.0,
        [
            ["BlockStored", [7, 8], None, TOKENS, 16, None, "GPU"],
            ["BlockStored", [7, 8], None, TOKENS, 16, None, "CPU_TIER1"],  # backed up; the GPU keeps its copy
            ["BlockRemoved", [8], "GPU"],
        ],
    ]
    engine._publish_batch(0, batch)
    [report] = engine.load()
    assert report.kv_total_blocks == 100
    assert report.tiers == [TierLoad(medium="cpu", total_blocks=300, used_blocks=2, usage=2 / 300)]


def test_a_worker_without_the_hierarchical_cache_reports_no_tiers() -> None:
    [report] = engine_with({}, [LoadSnapshot(max_total_num_tokens=1600)]).load()
    assert report.tiers is None


def test_each_attention_dp_rank_reports_its_own_tiers() -> None:
    args = {**HICACHE, "enable_dp_attention": True, "dp_size": 2, "hicache_storage_backend": "file"}
    snapshots = [LoadSnapshot(dp_rank=0, max_total_num_tokens=1600), LoadSnapshot(dp_rank=1, max_total_num_tokens=800)]
    engine = engine_with(args, snapshots)
    engine._publish_batch(1, [0.0, [["BlockStored", [7], None, TOKENS[:16], 16, None, "CPU_TIER2"]]])
    first, second = engine.load()
    assert first.tiers == [
        TierLoad(medium="cpu", total_blocks=300, used_blocks=0, usage=0.0),
        TierLoad(medium="disk", used_blocks=0),
    ]
    assert second.tiers == [
        TierLoad(medium="cpu", total_blocks=150, used_blocks=0, usage=0.0),
        TierLoad(medium="disk", used_blocks=1),
    ]
