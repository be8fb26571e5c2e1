"""The node's inventory, as the heartbeat sends it: host, CPUs (and their utilisation), memory, and GPUs.

GPUs come from NVML (``nvidia-ml-py``, imported as ``pynvml``) when its library and a driver are there,
and are none otherwise: a node without NVIDIA GPUs is a CPU node, not an error. ``--gpus`` declares
simulated GPUs instead (``parse_gpu_spec``), so that a laptop can act as a GPU node in tests and demos;
their memory "used" is what the agent's workers on them declared (the supervisor's
``gpu_memory_in_use()``), since nothing real is allocated. CPU utilisation is measured since the previous
heartbeat's read (agent/cpu_usage.py): the first, and a machine without ``/proc/stat``, have none.
"""

import logging
import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec

from agent.cpu_usage import CpuMeter
from runtime.errors import ConfigError

log = logging.getLogger(__name__)

MAX_GPUS = 64
_UNITS = {"MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([A-Za-z]+)")
# "2x24GiB": a count, then the size of each; "24GiB" alone is one GPU.
_GPU_ITEM = re.compile(r"(?:(\d+)\s*[xX]\s*)?(\S.*)")
_GPU_SPEC_HELP = 'write e.g. "2x24GiB", "24GiB,80GiB" or "2x24GiB,80GiB" (units MiB, GiB, TiB, MB, GB, TB)'


class GpuInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One GPU as the control plane records it (field names as in its Gpu rows)."""

    index: int
    name: str
    uuid: str
    memory_total_bytes: int
    memory_used_bytes: int
    utilization_percent: int
    simulated: bool = False


class NodeInventory(msgspec.Struct, frozen=True, kw_only=True):
    """What a heartbeat reports about the node (sent as JSON: ``msgspec.json.encode(inventory)``)."""

    hostname: str
    cpu_count: int
    memory_total_bytes: int
    memory_available_bytes: int
    gpus: list[GpuInfo]
    #: Percent of all CPUs' time busy since the previous read (agent/cpu_usage.py); None: not measured.
    cpu_utilization_percent: float | None = None


def parse_size(text: str, *, what: str = "size") -> int:
    """``24GiB``, ``80GB``, ``512MiB`` -> bytes. Raises ConfigError naming ``what``."""
    match = _SIZE.fullmatch(text.strip())
    unit = _UNITS.get(match.group(2).upper()) if match else None
    if match is None or unit is None:
        raise ConfigError(f"{what}: {text.strip()!r} is not a size; {_GPU_SPEC_HELP}")
    size = int(float(match.group(1)) * unit)
    if size <= 0:
        raise ConfigError(f"{what}: {text.strip()!r} is not a positive size")
    return size


def parse_gpu_spec(text: str) -> list[int]:
    """A ``--gpus`` spec -> each simulated GPU's memory in bytes, in index order.

    ``2x24GiB`` is two GPUs of 24 GiB; items are comma-separated (``2x24GiB,80GiB`` is three).
    Raises ConfigError naming ``--gpus`` (FLOTILLA_GPUS) and the forms it takes.
    """
    what = "--gpus (FLOTILLA_GPUS)"
    totals: list[int] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            raise ConfigError(f"{what}: {text!r} has an empty item; {_GPU_SPEC_HELP}")
        match = _GPU_ITEM.fullmatch(item)
        if match is None:
            raise ConfigError(f"{what}: {item!r} is not COUNTxSIZE or SIZE; {_GPU_SPEC_HELP}")
        count = int(match.group(1) or 1)
        if count < 1:
            raise ConfigError(f"{what}: {item!r} declares no GPU (the count must be at least 1)")
        if len(totals) + count > MAX_GPUS:
            raise ConfigError(f"{what}: {text!r} declares more GPUs than a node holds (at most {MAX_GPUS})")
        totals.extend([parse_size(match.group(2), what=f"{what} item {item!r}")] * count)
    return totals


def read_memory(meminfo: Path = Path("/proc/meminfo")) -> tuple[int, int]:
    """(total, available) bytes of this machine's memory, from ``/proc/meminfo``; (0, 0) if unreadable."""
    try:
        text = meminfo.read_text()
    except OSError:
        return 0, 0
    values: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            values[name] = int(fields[0]) * 1024  # meminfo counts kB (KiB)
    return values.get("MemTotal", 0), values.get("MemAvailable", values.get("MemFree", 0))


class Inventory:
    """Reads the node's inventory; owns the NVML session (``close()`` ends it).

    ``simulated_gpus`` (memory per GPU, from ``parse_gpu_spec``) replaces NVML entirely when given. ``cpu_meter``
    measures the CPU utilisation between reads (one on ``/proc/stat`` unless given).
    """

    def __init__(
        self,
        simulated_gpus: list[int] | None = None,
        *,
        nvml: ModuleType | None = None,
        cpu_meter: CpuMeter | None = None,
    ) -> None:
        self._simulated = simulated_gpus
        self._cpu_meter = cpu_meter or CpuMeter()
        # The module under test may be injected; otherwise pynvml is imported on first use.
        self._nvml = nvml
        self._nvml_ready = False
        self._nvml_tried = False

    def read(self, simulated_used: Mapping[int, int] | None = None, *, measure_cpu: bool = False) -> NodeInventory:
        """The inventory now. ``simulated_used``: bytes the agent's workers declared per simulated GPU.
        ``measure_cpu``: with the CPU utilisation since the last read that measured it (the heartbeats' reads;
        a start's check of its GPUs does not, so that the heartbeats' figure spans the time between them).

        Never raises for missing or failing NVML: GPUs that cannot be read are left out (and logged).
        """
        total, available = read_memory()
        if self._simulated is not None:
            gpus = _simulated_gpus(self._simulated, simulated_used or {})
        else:
            gpus = self._nvml_gpus()
        return NodeInventory(
            hostname=socket.gethostname(),
            cpu_count=os.cpu_count() or 1,
            memory_total_bytes=total,
            memory_available_bytes=available,
            gpus=gpus,
            cpu_utilization_percent=self._cpu_meter.read() if measure_cpu else None,
        )

    def _start_nvml(self) -> Any:
        """The initialised pynvml module, or None when there is no NVML (logged once, at info)."""
        if self._nvml_tried:
            return self._nvml if self._nvml_ready else None
        self._nvml_tried = True
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            self._nvml.nvmlInit()
        except ImportError:
            log.info("nvidia-ml-py is not installed: reporting no GPUs")
            return None
        except Exception as exc:  # pynvml.NVMLError and its many subclasses; no driver is the common case
            log.info("no NVIDIA GPUs found (NVML: %s): reporting none", exc)
            return None
        self._nvml_ready = True
        return self._nvml

    def _nvml_gpus(self) -> list[GpuInfo]:
        nvml = self._start_nvml()
        if nvml is None:
            return []
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as exc:
            log.warning("NVML cannot count the GPUs (%s): reporting none this time", exc)
            return []
        gpus = []
        for index in range(count):
            try:
                gpus.append(_nvml_gpu(nvml, index))
            except Exception as exc:
                # A GPU that fell off the bus must not hide the others.
                log.warning("NVML cannot read GPU %d (%s): leaving it out", index, exc)
        return gpus

    def close(self) -> None:
        """End the NVML session, if one was started."""
        if self._nvml_ready and self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception as exc:
                log.debug("nvmlShutdown failed: %s", exc)
        self._nvml_ready = False


def _text(value: object) -> str:
    # Older nvidia-ml-py versions return bytes for names and UUIDs.
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _nvml_gpu(nvml: Any, index: int) -> GpuInfo:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    try:
        utilization = int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:
        utilization = 0  # not supported on some devices (MIG slices among them)
    return GpuInfo(
        index=index,
        name=_text(nvml.nvmlDeviceGetName(handle)),
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        memory_total_bytes=int(memory.total),
        memory_used_bytes=int(memory.used),
        utilization_percent=utilization,
    )


def _simulated_gpus(totals: list[int], used: Mapping[int, int]) -> list[GpuInfo]:
    return [
        GpuInfo(
            index=index,
            name=f"simulated-{index}",
            uuid=f"GPU-simulated-{socket.gethostname()}-{index}",
            memory_total_bytes=total,
            memory_used_bytes=min(total, used.get(index, 0)),
            utilization_percent=0,
            simulated=True,
        )
        for index, total in enumerate(totals)
    ]
