"""What a node agent does once when it starts: adopt the workers a previous agent left running, then
reconcile them with the control plane, resuming the starts the previous agent left under way.

Workers outlive the agent (agent/workers/supervisor.py adopts them through their records); their attempts come
back from agent/workers/attempt_files.py, and the starts whose worker was not launched yet (a download under
way, typically) from agent/instances/start_files.py. The control plane's list of the node's instances, once it
answers, settles the rest: a start it still has pending or downloading here, at the same attempt and
incarnation, is carried on (its download resumes from its partial files, reporting progress) and the others
are dropped; the workers it no longer wants are stopped (agent/instances/ownership_checks.py), an instance it
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
from agent.instances.start_files import StartFiles
from agent.instances.table import InstanceTable
from agent.reported_downloads import ReportedDownloads
from agent.tasks.intake import TaskIntake
from agent.workers.attempt_files import AttemptFiles
from agent.workers.supervisor import Supervisor
from runtime.backoff import Backoff
from runtime.fleet_contract.tasks import StartInstance

log = logging.getLogger(__name__)

#: Listed states in which a start is still the control plane's, not yet carried out: pending (the start is on
#: its way, or was taken) and downloading.
RESUMABLE_STATES = frozenset({"pending", "downloading"})


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
        starts: StartFiles,
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
        self._starts = starts
        self._supervisor = supervisor
        self._intake = intake
        self._ownership = ownership
        self._downloads = downloads
        self._reports = reports
        # The starts a previous agent left under way, until the control plane's list decides about them.
        self._interrupted: list[StartInstance] = []

    async def adopt(self) -> None:
        """Take over the workers a previous agent left running, each at the attempt it recorded, and note the
        starts it left under way."""
        adopted = await self._supervisor.adopt()
        for instance_id in adopted:
            attempt, incarnation = self._attempts.load(instance_id)
            self._instances.add(instance_id, attempt, incarnation)
        self._attempts.forget_all_but(set(adopted))
        if adopted:
            log.info("adopted %d running worker(s): instances %s", len(adopted), ", ".join(map(str, adopted)))
        for request in self._starts.load_all():
            entry = self._instances.get(request.spec.instance_id)
            if entry is not None and (entry.attempt, entry.incarnation) == (request.attempt, request.incarnation):
                self._starts.forget_start(request)  # its worker was launched (and is adopted)
            else:
                self._interrupted.append(request)
        if self._interrupted:
            log.info(
                "found %d start(s) under way when the previous agent ended: instances %s",
                len(self._interrupted),
                ", ".join(str(request.spec.instance_id) for request in self._interrupted),
            )

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
        # Before the comparisons below: a resumed start is an operation under way, not a missing worker.
        await self._resume_interrupted(rows)
        context = "found when the agent started"
        await self._ownership.stop_disowned(rows, accepted, asked_at, context)
        # What the control plane thinks runs (or stops) here and does not: a worker that ended while no
        # agent watched it was reported failed by the adoption already, with its log's last lines.
        self._ownership.report_missing(rows, accepted, asked_at, context)

    async def _resume_interrupted(self, rows: list[AgentInstance]) -> None:
        """Carry on each start the previous agent left under way that ``rows`` still has pending or downloading
        here at the same attempt and incarnation; drop the others."""
        listed = {row.id: row for row in rows}
        interrupted, self._interrupted = self._interrupted, []
        for request in interrupted:
            instance_id = request.spec.instance_id
            entry = self._instances.get(instance_id)
            if entry is not None and (entry.accepted or entry.operation is not None):
                # A start or stop of it came from the queue since this agent started: that one decides.
                log.info("instance %d: a task since the agent started replaces its interrupted start", instance_id)
                continue
            why_not = _why_not_resumed(request, listed.get(instance_id))
            if why_not is not None:
                log.info("instance %d: not resuming its start of attempt %d: %s", instance_id, request.attempt, why_not)
                self._starts.forget_start(request)
                continue
            log.info(
                "instance %d: resuming its start of attempt %d, under way when the previous agent ended",
                instance_id,
                request.attempt,
            )
            await self._intake.accept_start(request)


def _why_not_resumed(request: StartInstance, row: AgentInstance | None) -> str | None:
    """Why the control plane's ``row`` of the instance does not want ``request`` carried on; None if it does."""
    if row is None:
        return "the control plane has it on no node, or another one"
    if row.state not in RESUMABLE_STATES:
        return f"the control plane has it {row.state}"
    if row.attempt != request.attempt:
        return f"the control plane is at attempt {row.attempt}"
    if row.incarnation and request.incarnation and row.incarnation != request.incarnation:
        return f"the control plane's instance of that id is another one (incarnation {row.incarnation})"
    return None
