"""Every engine's KV tier names, as Flotilla's tiers (engines/shared/kv_tiers.py)."""

import pytest

from engines.shared.kv_tiers import tier_of_level, tier_of_name


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
