"""What a node agent does once when it starts: adopt the workers a previous agent left running, then
reconcile them with the control plane.

Workers outlive the agent (agent/workers/supervisor.py adopts them through their records); their attempts come
back from agent/workers/attempt_files.py. The control plane's list of the node's instances, once it answers,
settles the rest: the workers it no longer wants are stopped (agent/instances/ownership_checks.py), an instance it
thinks is stopping here is reported stopped, and one it thinks runs here but does not is reported failed.
"""

import asyncio
import logging
import time
from typing import Protocol

from agent.control_plane_client import (
    CONTROL_PLANE_RETRY_JITTER,
    AgentInstance,
    ControlPlaneRefused,
    ControlPlaneUnreachable,
    TokenRejected,
)
from agent.instances.ownership_checks import OwnershipChecks
from agent.instances.reports import InstanceReporter
from agent.instances.table import InstanceTable
from agent.reported_downloads import ReportedDownloads
from agent.tasks.intake import TaskIntake
from agent.workers.attempt_files import AttemptFiles
from agent.workers.supervisor import Supervisor
from runtime.backoff import Backoff

log = logging.getLogger(__name__)


class InstanceLister(Protocol):
    """What the reconciliation needs of the control plane: its list of the node's instances."""

    async def list_instances(self) -> list[AgentInstance]: ...


class StartupReconciliation:
    """Adopts the workers left running (``adopt()``), then matches them with the control plane's list
    (``reconcile()``, retrying until the control plane answers)."""

    def __init__(
        self,
        *,
        node: str,
        client: InstanceLister,
        instances: InstanceTable,
        attempts: AttemptFiles,
        supervisor: Supervisor,
        intake: TaskIntake,
        ownership: OwnershipChecks,
        downloads: ReportedDownloads,
        reports: InstanceReporter,
    ) -> None:
        self._node = node
        self._client = client
        self._instances = instances
        self._attempts = attempts
        self._supervisor = supervisor
        self._intake = intake
        self._ownership = ownership
        self._downloads = downloads
        self._reports = reports

    async def adopt(self) -> None:
        """Take over the workers a previous agent left running, each at the attempt it recorded."""
        adopted = await self._supervisor.adopt()
        for instance_id in adopted:
            attempt, incarnation = self._attempts.load(instance_id)
            self._instances.add(instance_id, attempt, incarnation)
        self._attempts.forget_all_but(set(adopted))
        if adopted:
            log.info("adopted %d running worker(s): instances %s", len(adopted), ", ".join(map(str, adopted)))

    async def reconcile(self) -> None:
        """Match the workers running here with what the control plane wants (after an agent restart)."""
        backoff = Backoff(1.0, 30.0, jitter=CONTROL_PLANE_RETRY_JITTER)
        while True:
            accepted, asked_at = self._instances.starts_accepted, time.monotonic()
            try:
                rows = await self._client.list_instances()
                break
            except ControlPlaneUnreachable:
                await asyncio.sleep(backoff.next())
            except TokenRejected:
                return
            except ControlPlaneRefused as exc:
                log.error("cannot reconcile the workers with the control plane: %s", exc)
                return
        self._downloads.learn_models(rows)
        context = "found when the agent started"
        await self._ownership.stop_disowned(rows, accepted, asked_at, context)
        # What the control plane thinks runs (or stops) here and does not: a worker that ended while no
        # agent watched it was reported failed by the adoption already, with its log's last lines.
        self._ownership.report_missing(rows, accepted, asked_at, context)
