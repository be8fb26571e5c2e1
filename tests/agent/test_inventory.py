"""The node inventory: the --gpus spec, simulated GPUs, NVML when present, and no GPUs without it."""

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from agent.cpu_usage import CpuMeter
from agent.inventory import GpuInfo, Inventory, NodeInventory, parse_gpu_spec, read_memory
from runtime.errors import ConfigError

GIB = 1 << 30


def test_a_gpu_spec_takes_counts_sizes_and_lists() -> None:
    assert parse_gpu_spec("2x24GiB") == [24 * GIB, 24 * GIB]
    assert parse_gpu_spec("24GiB,80GiB") == [24 * GIB, 80 * GIB]
    assert parse_gpu_spec("2X24GiB, 80GB") == [24 * GIB, 24 * GIB, 80 * 10**9]
    assert parse_gpu_spec("512MiB") == [512 << 20]


@pytest.mark.parametrize(
    ("spec", "complaint"),
    [
        ("", "empty item"),
        ("24GiB,,80GiB", "empty item"),
        ("24", "'24' is not a size"),
        ("0x24GiB", "declares no GPU"),
        ("2x", "is not a size"),
        ("24 parsecs", "is not a size"),
        ("2x0GiB", "not a positive size"),
        ("65x1GiB", "at most 64"),
    ],
)
def test_a_bad_gpu_spec_is_a_config_error_naming_the_flag(spec: str, complaint: str) -> None:
    with pytest.raises(ConfigError, match="--gpus") as raised:
        parse_gpu_spec(spec)
    assert complaint in str(raised.value)


def test_simulated_gpus_report_the_memory_their_workers_declared() -> None:
    inventory = Inventory([24 * GIB, 80 * GIB]).read({1: 30 * GIB, 5: GIB})
    assert [(gpu.index, gpu.name, gpu.simulated) for gpu in inventory.gpus] == [
        (0, "simulated-0", True),
        (1, "simulated-1", True),
    ]
    assert [gpu.memory_used_bytes for gpu in inventory.gpus] == [0, 30 * GIB]
    assert all(gpu.memory_total_bytes > gpu.memory_used_bytes for gpu in inventory.gpus)


def test_the_inventory_travels_as_json_the_control_plane_reads() -> None:
    inventory = Inventory([GIB]).read()
    decoded = msgspec.json.decode(msgspec.json.encode(inventory))
    assert set(decoded) == {
        "hostname",
        "cpu_count",
        "memory_total_bytes",
        "memory_available_bytes",
        "gpus",
        "cpu_utilization_percent",
    }
    assert decoded["gpus"][0]["memory_total_bytes"] == GIB
    assert msgspec.json.decode(msgspec.json.encode(inventory), type=NodeInventory) == inventory
    assert inventory.cpu_count >= 1
    assert 0 < inventory.memory_available_bytes <= inventory.memory_total_bytes


def test_the_cpu_utilisation_is_measured_between_heartbeats_reads_none_at_the_first(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 0 900 0 0 0 0 0 0\n")
    inventory = Inventory([GIB], cpu_meter=CpuMeter(stat))
    assert inventory.read(measure_cpu=True).cpu_utilization_percent is None
    stat.write_text("cpu  130 0 0 970 0 0 0 0 0 0\n")
    assert inventory.read().cpu_utilization_percent is None  # a start's GPU check: not a heartbeat's read
    stat.write_text("cpu  160 0 20 1000 20 0 0 0 0 0\n")  # 80 busy of 200 ticks since the first read
    assert inventory.read(measure_cpu=True).cpu_utilization_percent == 40.0


def test_memory_comes_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       2048 kB\nMemFree:         512 kB\nMemAvailable:   1024 kB\n")
    assert read_memory(meminfo) == (2048 * 1024, 1024 * 1024)
    assert read_memory(tmp_path / "missing") == (0, 0)


class _FakeNvmlError(Exception):
    pass


class FakeNvml:
    """pynvml's calls the inventory makes, over a list of devices; ``init_error`` fails nvmlInit."""

    def __init__(self, devices: list[dict[str, Any]], init_error: Exception | None = None) -> None:
        self.devices = devices
        self.init_error = init_error
        self.init_calls = 0
        self.shut_down = False

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.shut_down = True

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> dict[str, Any]:
        device = self.devices[index]
        if device.get("broken"):
            raise _FakeNvmlError("GPU is lost")
        return device

    def nvmlDeviceGetName(self, handle: dict[str, Any]) -> Any:
        return handle["name"]

    def nvmlDeviceGetUUID(self, handle: dict[str, Any]) -> Any:
        return handle["uuid"]

    def nvmlDeviceGetMemoryInfo(self, handle: dict[str, Any]) -> SimpleNamespace:
        return SimpleNamespace(total=handle["total"], used=handle["used"], free=handle["total"] - handle["used"])

    def nvmlDeviceGetUtilizationRates(self, handle: dict[str, Any]) -> SimpleNamespace:
        if "utilization" not in handle:
            raise _FakeNvmlError("Not Supported")
        return SimpleNamespace(gpu=handle["utilization"], memory=0)


def test_nvml_gpus_are_read_with_their_memory_and_utilisation() -> None:
    nvml = FakeNvml(
        [
            {"name": b"NVIDIA H100", "uuid": b"GPU-aaaa", "total": 80 * GIB, "used": GIB, "utilization": 37},
            {"name": "NVIDIA H100", "uuid": "GPU-bbbb", "total": 80 * GIB, "used": 0},
        ]
    )
    inventory = Inventory(nvml=nvml)  # type: ignore[arg-type]
    gpus = inventory.read().gpus
    assert gpus == [
        GpuInfo(
            index=0,
            name="NVIDIA H100",
            uuid="GPU-aaaa",
            memory_total_bytes=80 * GIB,
            memory_used_bytes=GIB,
            utilization_percent=37,
        ),
        GpuInfo(
            index=1,
            name="NVIDIA H100",
            uuid="GPU-bbbb",
            memory_total_bytes=80 * GIB,
            memory_used_bytes=0,
            utilization_percent=0,
        ),
    ]
    inventory.read()
    assert nvml.init_calls == 1  # one NVML session for the agent's life
    inventory.close()
    assert nvml.shut_down


def test_a_gpu_nvml_cannot_read_is_left_out_and_the_others_reported() -> None:
    nvml = FakeNvml(
        [{"broken": True}, {"name": "NVIDIA A10", "uuid": "GPU-cccc", "total": 24 * GIB, "used": 0, "utilization": 0}]
    )
    gpus = Inventory(nvml=nvml).read().gpus  # type: ignore[arg-type]
    assert [(gpu.index, gpu.name) for gpu in gpus] == [(1, "NVIDIA A10")]


def test_no_nvml_library_means_no_gpus_logged_once_at_info(caplog: pytest.LogCaptureFixture) -> None:
    nvml = FakeNvml([], init_error=_FakeNvmlError("NVML Shared Library Not Found"))
    inventory = Inventory(nvml=nvml)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="agent.inventory"):
        assert inventory.read().gpus == []
        assert inventory.read().gpus == []
    messages = [record for record in caplog.records if "NVML" in record.getMessage()]
    assert len(messages) == 1 and messages[0].levelno == logging.INFO
    assert nvml.init_calls == 1


def test_the_real_pynvml_on_a_machine_without_a_driver_reports_no_gpus() -> None:
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver: the no-NVML path is not reachable here")
    assert Inventory().read().gpus == []
