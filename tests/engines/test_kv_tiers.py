"""Every engine's KV tier names, as Flotilla's tiers (engines/shared/kv_tiers.py)."""

import pytest

from engines.shared.engine_block_names import EngineBlockNames
from engines.shared.kv_tiers import tier_loads, tier_of_level, tier_of_name
from runtime.kv.events import TierLoad


@pytest.mark.parametrize(
    ("name", "tier"),
    [
        ("GPU", None),
        ("DEVICE", None),
        ("gpu", None),
        ("CPU", "cpu"),  # vLLM's offloading connector
        ("CPU_PINNED", "cpu"),
        ("CPU_TIER1", "cpu"),  # SGLang's host memory
        ("CPU_TIER2", "disk"),  # SGLang's storage backend
        ("DISK", "disk"),
        ("NVME", "disk"),
        ("STORAGE", "disk"),  # vLLM's tiering and simple offload backends
        ("EXTERNAL", "external"),
        ("NETWORK", "external"),
        ("REMOTE", "external"),
        ("SHARED", "external"),
        ("external", "external"),
    ],
)
def test_each_engines_tier_name_is_read_as_flotillas_tier(name: str, tier: str | None) -> None:
    assert tier_of_name(name) == tier


def test_no_tier_name_is_the_device() -> None:
    assert tier_of_name(None) is None


@pytest.mark.parametrize("name", ["HBM3_SOMEWHERE", "", 7, b"CPU"])
def test_a_name_flotilla_does_not_know_is_external_never_the_device(name: object) -> None:
    assert tier_of_name(name) == "external"


@pytest.mark.parametrize(("level", "tier"), [(None, None), (0, None), (1, "cpu"), (2, "external"), ("1", "external")])
def test_trtllms_cache_levels_are_the_gpu_pool_the_host_pool_and_else_external(level: object, tier: str | None) -> None:
    assert tier_of_level(level) == tier


def test_a_worker_that_offloads_nothing_reports_no_tiers() -> None:
    names = EngineBlockNames(block_size=4)
    names.stored([1], None, [1, 2, 3, 4])
    assert tier_loads(names) is None


def test_a_configured_tier_is_reported_empty_and_a_tier_the_events_fill_is_reported_too() -> None:
    names = EngineBlockNames(block_size=4)
    names.stored([1, 2], None, list(range(8)), medium="disk")
    assert tier_loads(names, offloads_to=["cpu"], total_blocks={"cpu": 100}, hit_rates={"cpu": 0.25}) == [
        TierLoad(medium="cpu", total_blocks=100, used_blocks=0, usage=0.0, hit_rate=0.25),
        TierLoad(medium="disk", used_blocks=2),
    ]


def test_a_tiers_usage_is_its_held_blocks_of_its_size_at_most_one() -> None:
    names = EngineBlockNames(block_size=4)
    names.stored([1, 2, 3], None, list(range(12)), medium="cpu")
    [host] = tier_loads(names, offloads_to=["cpu"], total_blocks={"cpu": 2}) or []
    assert (host.used_blocks, host.usage) == (3, 1.0)  # events lost or a size rounded: never above full
