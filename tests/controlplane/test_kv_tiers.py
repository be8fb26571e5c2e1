"""kv_tiers.host_tier_args: a pipeline's host KV tier as each engine's own settings (a pure function)."""

import pytest

from controlplane.deployments.kv_tiers import MOCKER_DEFAULT_BLOCK_SIZE, HostTierRefused, host_tier_args
from engines.mocker.config import MockerConfig

SMOL_BYTES_PER_TOKEN = 23040  # SmolLM2-135M in bf16


def test_no_host_tier_adds_nothing_whatever_the_engine() -> None:
    assert host_tier_args("llamacpp", {}, 0, 0) == {}
    assert host_tier_args("echo_core", {}, None, 0) == {}


def test_the_mocker_gets_its_tier_in_blocks_of_its_block_size() -> None:
    args = {"kv_bytes_per_token": SMOL_BYTES_PER_TOKEN, "block_size": 16}
    # 8 GiB / (23040 bytes × 16 tokens) = 23301.68… blocks, rounded down.
    assert host_tier_args("mocker", args, 8, 0) == {"num_host_blocks": 23301}


def test_the_mocker_without_a_block_size_counts_blocks_of_its_default_64_tokens() -> None:
    assert host_tier_args("mocker", {"kv_bytes_per_token": 1024}, 1, 0) == {"num_host_blocks": 16384}
    assert MockerConfig().block_size == MOCKER_DEFAULT_BLOCK_SIZE  # the control plane's copy of the default


def test_the_mockers_tier_is_split_over_its_dp_ranks_as_each_keeps_its_own() -> None:
    args = {"kv_bytes_per_token": 1024, "block_size": 64, "dp_size": 4}
    assert host_tier_args("mocker", args, 1, 0) == {"num_host_blocks": 4096}


def test_the_mocker_without_kv_bytes_per_token_is_refused_naming_the_key() -> None:
    with pytest.raises(HostTierRefused, match="engine args need 'kv_bytes_per_token'"):
        host_tier_args("mocker", {"block_size": 16}, 8, 0)


@pytest.mark.parametrize("value", ["23040", 0, -1, 1.5, True])
def test_the_mocker_with_a_bad_kv_bytes_per_token_is_refused_naming_it(value: object) -> None:
    with pytest.raises(HostTierRefused, match="'kv_bytes_per_token' must be a whole number above 0"):
        host_tier_args("mocker", {"kv_bytes_per_token": value}, 8, 0)


def test_a_mocker_tier_too_small_for_one_block_is_refused_saying_the_least_that_holds_one() -> None:
    with pytest.raises(HostTierRefused, match=r"holds no block of 1474560 bytes .* at least 0.00137329 GiB"):
        host_tier_args("mocker", {"kv_bytes_per_token": SMOL_BYTES_PER_TOKEN}, 0.001, 0)


def test_vllm_gets_its_native_offloading_in_gib_for_the_whole_replica() -> None:
    assert host_tier_args("vllm", {}, 16.5, 4) == {"kv_offloading_backend": "native", "kv_offloading_size": 16.5}


def test_vllm_keeps_an_offloading_backend_its_engine_args_name() -> None:
    args = host_tier_args("vllm", {"kv_offloading_backend": "lmcache"}, 8, 1)
    assert args == {"kv_offloading_backend": "lmcache", "kv_offloading_size": 8}


def test_sglang_gets_its_hierarchical_cache_in_whole_gb_per_gpu() -> None:
    # 64 GiB = 68.72 GB over 2 GPUs: 34 GB each, rounded down (never more than placement reserved).
    assert host_tier_args("sglang", {}, 64, 2) == {"enable_hierarchical_cache": True, "hicache_size": 34}


def test_sglang_refuses_a_tier_under_a_gb_per_gpu_since_0_would_mean_its_ratio() -> None:
    with pytest.raises(HostTierRefused, match="whole GB per GPU: 4 GPU"):
        host_tier_args("sglang", {}, 2, 4)


def test_sglang_refuses_a_tier_with_the_hierarchical_cache_turned_off() -> None:
    with pytest.raises(HostTierRefused, match="turn enable_hierarchical_cache off"):
        host_tier_args("sglang", {"enable_hierarchical_cache": False}, 8, 1)


@pytest.mark.parametrize(
    ("engine", "key"),
    [
        ("mocker", "num_host_blocks"),
        ("vllm", "kv_offloading_size"),
        ("sglang", "hicache_size"),
        ("sglang", "hicache_ratio"),
    ],
)
def test_engine_args_that_size_the_tier_themselves_are_refused_naming_the_key(engine: str, key: str) -> None:
    with pytest.raises(HostTierRefused, match=f"engine args set '{key}', which kv_host_cache_gib sets"):
        host_tier_args(engine, {key: 2, "kv_bytes_per_token": 1024}, 8, 1)


@pytest.mark.parametrize("engine", ["llamacpp", "mistralrs", "echo_core", "echo_full", "trtllm"])
def test_an_engine_without_a_host_tier_is_refused_naming_those_with_one(engine: str) -> None:
    with pytest.raises(
        HostTierRefused, match=f"^{engine} keeps no KV cache tier in host memory; .*mocker, vllm, sglang"
    ):
        host_tier_args(engine, {}, 8, 1)
