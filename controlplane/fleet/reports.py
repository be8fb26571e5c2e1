"""What agents report about their nodes, as plain data the fleet actions take (the API validates, then builds
these). Their reports about instances are ``controlplane.deployments.reports``."""

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class GpuReport:
    index: int
    name: str
    memory_total_bytes: int
    memory_used_bytes: int = 0
    utilization_percent: int = 0
    #: NVML's UUID ("GPU-…", "MIG-…"): what a worker's CUDA_VISIBLE_DEVICES names; "" from agents that do not say.
    uuid: str = ""


@dataclass(frozen=True, slots=True)
class NodeReport:
    """A node's inventory: sent at registration and with every heartbeat."""

    address: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    cpu_count: int = 0
    memory_total_bytes: int = 0
    memory_available_bytes: int = 0
    agent_version: str = ""
    gpus: tuple[GpuReport, ...] = ()
    #: The machine the agent runs on (controlplane/fleet/machines.py); "" when the agent does not say.
    machine_id: str = ""
    #: The engines the node's agent can run, sorted; None when the agent does not say (older agents): the
    #: node keeps what it had (``Node.engines``).
    engines: tuple[str, ...] | None = None

    def hardware(self) -> dict[str, Any]:
        """What changes only when the machine does (the audit log records such changes, not usage)."""
        return {
            "cpu_count": self.cpu_count,
            "memory_total_bytes": self.memory_total_bytes,
            "gpus": [
                [gpu.index, gpu.name, gpu.uuid, gpu.memory_total_bytes] for gpu in sorted(self.gpus, key=_by_index)
            ],
        }


@dataclass(frozen=True, slots=True)
class DownloadReport:
    state: str
    bytes_done: int = 0
    bytes_total: int | None = None
    error: str = ""


def _by_index(gpu: GpuReport) -> int:
    return gpu.index
