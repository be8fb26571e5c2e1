"""agent/gpu_check.py: a start runs only on the GPUs the control plane reserved, named to CUDA by UUID."""

import pytest

from agent.gpu_check import GpuMismatch, check_gpus, named_by_uuid
from agent.inventory import GpuInfo
from agent.workers.spec import worker_env
from runtime.fleet_contract.tasks import WorkerSpec


def gpu(index: int, uuid: str, *, simulated: bool = False) -> GpuInfo:
    return GpuInfo(
        index=index,
        name="H100",
        uuid=uuid,
        memory_total_bytes=80 << 30,
        memory_used_bytes=0,
        utilization_percent=0,
        simulated=simulated,
    )


NODE = [gpu(0, "GPU-aaaa"), gpu(1, "GPU-bbbb"), gpu(2, "GPU-cccc")]


def spec(indexes: list[int], uuids: list[str]) -> WorkerSpec:
    return WorkerSpec(
        instance_id=1, pipeline="p", group="aggregated", replica=0, engine="vllm", gpu_indexes=indexes, gpu_uuids=uuids
    )


def test_the_reserved_gpus_pass_and_are_named_to_cuda_by_uuid() -> None:
    placed = spec([2, 0], ["GPU-cccc", "GPU-aaaa"])
    check_gpus(placed, NODE)
    env = worker_env(named_by_uuid(placed, NODE), {})
    assert (env["CUDA_VISIBLE_DEVICES"], env["CUDA_DEVICE_ORDER"]) == ("GPU-cccc,GPU-aaaa", "PCI_BUS_ID")


def test_a_gpu_swapped_since_the_last_heartbeat_is_refused_naming_both() -> None:
    with pytest.raises(GpuMismatch, match="GPU 1 is GPU-bbbb on this node, but the control plane reserved GPU-9999"):
        check_gpus(spec([0, 1], ["GPU-aaaa", "GPU-9999"]), NODE)


def test_indexes_shifted_by_a_gpu_gone_from_the_bus_are_refused() -> None:
    # GPU 1 fell off the bus: NVML now counts the old GPU 2 as 1, and there is no 2.
    shifted = [gpu(0, "GPU-aaaa"), gpu(1, "GPU-cccc")]
    with pytest.raises(GpuMismatch, match="GPU 1 is GPU-cccc on this node"):
        check_gpus(spec([1], ["GPU-bbbb"]), shifted)
    with pytest.raises(GpuMismatch, match=r"GPU 2 is not on this node \(it has 2\)"):
        check_gpus(spec([2], ["GPU-cccc"]), shifted)


def test_a_spec_without_uuids_is_checked_by_index_and_then_named_by_this_nodes_uuids() -> None:
    older = spec([1], [])  # from a control plane that has no UUIDs for the node yet
    check_gpus(older, NODE)
    assert named_by_uuid(older, NODE).gpu_uuids == ["GPU-bbbb"]


def test_a_malformed_spec_with_more_indexes_than_uuids_is_refused() -> None:
    with pytest.raises(GpuMismatch, match="2 GPU indexes and 1 UUIDs"):
        check_gpus(spec([0, 1], ["GPU-aaaa"]), NODE)


def test_simulated_gpus_keep_their_indexes() -> None:
    simulated = [gpu(0, "GPU-simulated-host-0", simulated=True), gpu(1, "GPU-simulated-host-1", simulated=True)]
    placed = spec([1], ["GPU-simulated-host-1"])
    check_gpus(placed, simulated)
    named = named_by_uuid(placed, simulated)
    assert worker_env(named, {})["CUDA_VISIBLE_DEVICES"] == "1"
