"""The node's inventory to the control plane: registered once, then sent every few seconds as a heartbeat.

A heartbeat is what keeps the node online in the control plane's eyes, so one bad round (a read that
failed, a bug) is logged and the next one tried; a control plane that no longer knows the node (its
database was reset, an admin deleted the node) gets it registered again. Simulated GPUs report as used
the memory that the workers on them declared, since nothing real is allocated (agent/inventory.py).
"""

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping
from typing import Protocol

from agent.control_plane_client import HeartbeatReply, NodeNotRegistered, NodeReport, TokenRejected, node_report
from agent.inventory import Inventory
from runtime.fleet_contract.reports import AdapterFailure

log = logging.getLogger(__name__)


class NodeRegistry(Protocol):
    """What the heartbeats need of the control plane."""

    async def register(self, report: NodeReport) -> None: ...

    async def heartbeat(self, report: NodeReport) -> HeartbeatReply | None: ...


class Heartbeats:
    """Reads the node's inventory into a NodeReport (name, address, version, machine id, engines, GPUs,
    CPUs, memory) and sends it: ``register()`` once, then ``run()`` every ``interval_s``."""

    def __init__(
        self,
        *,
        client: NodeRegistry,
        inventory: Inventory,
        gpu_memory_in_use: Callable[[], Mapping[int, int]],
        node: str,
        address: str,
        version: str,
        machine_id: str,
        engines: Collection[str],
        interval_s: float,
        adapter_failures: Callable[[], list[AdapterFailure]] = list,
    ) -> None:
        """``gpu_memory_in_use``: bytes the workers declared per GPU index (the supervisor's);
        ``adapter_failures``: the adapters the node could not fetch now (agent/adapter_files.py)."""
        self._client = client
        self._inventory = inventory
        self._gpu_memory_in_use = gpu_memory_in_use
        self._node = node
        self._address = address
        self._version = version
        self._machine_id = machine_id
        self._engines = engines
        self._interval_s = interval_s
        self._adapter_failures = adapter_failures

    async def node_report(self) -> NodeReport:
        """The node's inventory now (simulated GPUs' memory used: what the workers on them declared; the CPU
        utilisation since the previous report)."""
        inventory = await asyncio.to_thread(self._inventory.read, self._gpu_memory_in_use(), measure_cpu=True)
        return node_report(
            inventory,
            name=self._node,
            address=self._address,
            version=self._version,
            machine_id=self._machine_id,
            engines=self._engines,
            adapter_failures=self._adapter_failures(),
        )

    async def register(self) -> None:
        """Register the node (the client retries while the control plane does not answer).

        Raises TokenRejected, ConfigError (not the control plane's URL), ControlPlaneRefused.
        """
        await self._client.register(await self.node_report())

    async def run(self) -> None:
        """Send a heartbeat every ``interval_s`` until cancelled, or until the control plane rejects the token."""
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                report = await self.node_report()
                try:
                    await self._client.heartbeat(report)
                except NodeNotRegistered as exc:
                    log.warning("%s: registering it again", exc)
                    await self._client.register(report)
            except TokenRejected:
                return  # the client's ``rejected`` tells the main loop, which stops the agent
            except Exception:
                # One bad round (a bug, a read that failed) must not end the heartbeats: the node would go offline.
                log.exception("a heartbeat failed; trying again in %.0f s", self._interval_s)
