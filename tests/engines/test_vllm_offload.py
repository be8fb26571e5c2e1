"""vLLM's KV offloading with vLLM's CPU build: out=vllm's settings become vLLM's offloading connector, its events
told to carry their tokens (so host copies can be named for routers).

vLLM 0.32's CPU build cannot run offloading: its worker refuses it when the KV caches are registered ("CPU
Offloading is currently only supported on CUDA-alike and XPU GPUs", vllm/v1/kv_offload/cpu/spec.py), so the
engine is not started here; bench/gpu_engines_check.sh runs it on a GPU."""

import os
from pathlib import Path
from typing import Any

import pytest

from tests.engines.vllm_model import ENGINE_SETTINGS, KV_CACHE_ENV, VLLM_MARKS

pytestmark = [*VLLM_MARKS, pytest.mark.timeout(300)]


def vllm_config(folder: Path, extra: dict[str, Any]) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs

    from engines.vllm.settings import VllmSettings, check_extra_args, engine_arg_names

    check_extra_args(extra, engine_arg_names())  # what `flotilla run out=vllm --extra-engine-args` checks first
    os.environ.update(KV_CACHE_ENV)
    settings = VllmSettings(model=str(folder), max_model_len=2048, extra={**ENGINE_SETTINGS, **extra})
    return AsyncEngineArgs(**settings.engine_kwargs()).create_engine_config()


def test_kv_offloading_size_becomes_vllms_offloading_connector_with_self_describing_events(
    vllm_model_folder: Path,
) -> None:
    config = vllm_config(vllm_model_folder, {"kv_offloading_size": 0.25})
    transfer = config.kv_transfer_config
    assert (transfer.kv_connector, transfer.kv_role) == ("OffloadingConnector", "kv_both")
    assert transfer.kv_connector_extra_config == {
        "self_describing_kv_events": True,
        "cpu_bytes_to_use": 0.25 * (1 << 30),
    }


def test_an_offloading_connector_given_as_json_keeps_its_spec_and_gets_self_describing_events(
    vllm_model_folder: Path,
) -> None:
    given = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 1 << 28},
    }
    transfer = vllm_config(vllm_model_folder, {"kv_transfer_config": given}).kv_transfer_config
    assert transfer.kv_connector == "OffloadingConnector"
    assert transfer.kv_connector_extra_config == {
        "self_describing_kv_events": True,
        "spec_name": "CPUOffloadingSpec",
        "cpu_bytes_to_use": 1 << 28,
    }
