"""vLLM's KV offloading through out=vllm, checked without vLLM: which settings put blocks on the host tier, the
connector's events told to carry their tokens, and the host tier in the worker's load report."""

import sys
from types import ModuleType
from typing import Any

import pytest

from engines.shared.engine_block_names import EngineBlockNames
from engines.vllm.engine import VllmEngine
from engines.vllm.settings import VllmSettings, offload_tiers, with_self_describing_events
from runtime.kv.events import TierLoad

OFFLOADING = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}


@pytest.fixture
def fake_vllm_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """``vllm.config.KVTransferConfig`` as a dict, so that engine_kwargs() runs where vLLM is not installed."""
    package, config = ModuleType("vllm"), ModuleType("vllm.config")
    config.KVTransferConfig = dict  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", package)
    monkeypatch.setitem(sys.modules, "vllm.config", config)


@pytest.mark.parametrize(
    ("extra", "tiers"),
    [
        ({}, ()),
        ({"kv_offloading_size": 4}, ("cpu",)),
        ({"kv_offloading_size": 4, "kv_offloading_backend": "native"}, ("cpu",)),
        ({"kv_offloading_size": 4, "kv_offloading_backend": "lmcache"}, ()),  # LMCache's store is its server's
        ({"kv_transfer_config": OFFLOADING}, ("cpu",)),
        (
            {"kv_transfer_config": {**OFFLOADING, "kv_connector_extra_config": {"spec_name": "CPUOffloadingSpec"}}},
            ("cpu",),
        ),
        ({"kv_transfer_config": {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both"}}, ("cpu",)),
        ({"kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_both"}}, ()),
    ],
)
def test_the_settings_that_offload_to_host_memory_are_known(extra: dict[str, Any], tiers: tuple[str, ...]) -> None:
    assert offload_tiers(extra) == tiers


@pytest.mark.usefixtures("fake_vllm_config")
def test_offloading_by_size_gets_a_connector_config_whose_events_carry_their_tokens() -> None:
    kwargs = VllmSettings(model="m", extra={"kv_offloading_size": 4}).engine_kwargs()
    # vLLM names the connector and adds cpu_bytes_to_use to this config itself
    # (VllmConfig._post_init_kv_transfer_config).
    assert kwargs["kv_offloading_size"] == 4
    assert kwargs["kv_transfer_config"] == {"kv_connector_extra_config": {"self_describing_kv_events": True}}


@pytest.mark.usefixtures("fake_vllm_config")
def test_an_offloading_connector_keeps_its_own_extra_config_and_may_turn_the_events_off() -> None:
    given = {**OFFLOADING, "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}}
    kwargs = VllmSettings(model="m", extra={"kv_transfer_config": given}).engine_kwargs()
    assert kwargs["kv_transfer_config"]["kv_connector_extra_config"] == {
        "self_describing_kv_events": True,
        "cpu_bytes_to_use": 1 << 30,
    }
    off = {**OFFLOADING, "kv_connector_extra_config": {"self_describing_kv_events": False}}
    assert with_self_describing_events(off)["kv_connector_extra_config"] == {"self_describing_kv_events": False}


@pytest.mark.usefixtures("fake_vllm_config")
def test_a_connector_that_does_not_offload_is_left_as_given() -> None:
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    assert VllmSettings(model="m", extra={"kv_transfer_config": nixl}).engine_kwargs()["kv_transfer_config"] == nixl


def engine_with(extra: dict[str, Any]) -> VllmEngine:
    engine = VllmEngine(VllmSettings(model="m", extra=extra))
    engine._names = {0: EngineBlockNames(32)}
    return engine


def test_an_offloading_worker_reports_its_host_tiers_blocks_and_hits() -> None:
    engine = engine_with({"kv_offloading_size": 4})
    assert engine.load()[0].tiers == [TierLoad(medium="cpu", used_blocks=0)]  # nothing offloaded, no prompt yet
    engine._names[0].stored([1, 2], None, list(range(64)), medium="cpu")
    stats = engine._stats.rank(0)
    stats.prefix_queries, stats.prefix_hits, stats.connector_hits = 400, 100, 200
    [load] = engine.load()
    assert load.prefix_hit_rate == 0.25
    assert load.tiers == [TierLoad(medium="cpu", used_blocks=2, hit_rate=0.5)]


def test_a_worker_that_does_not_offload_reports_no_tiers() -> None:
    assert engine_with({}).load()[0].tiers is None
