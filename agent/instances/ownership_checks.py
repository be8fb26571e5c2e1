"""When the node agent compares its workers with the control plane's list of the node's instances, and
what it does with the verdict (the verdict itself is agent/instances/ownership.py's, a pure decision).

It compares every ``reconcile_s``, when the control plane answers again after an outage, and when it
refuses a report (403/404/409): the client's ``doubt()`` says so. The workers the list disowns are
stopped; a list that cannot be had changes nothing, since a control plane that does not answer is no
reason to stop anything. The instances the list has running here with no worker here are reported
(``report_missing``). A start accepted since the list was asked for, or shortly before (its
transaction may not be committed yet: ``listing_lag_s``), may be missing from it: such a worker is kept,
and looked at again after ``listing_lag_s``.
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import msgspec

from agent.adapter_files import AdapterFiles
from agent.control_plane_client import (
    AgentInstance,
    ControlPlaneRefused,
    ControlPlaneUnreachable,
    InstanceReport,
    TokenRejected,
)
from agent.instances.ownership import RUNNING_STATES, Started, disowned
from agent.instances.reports import InstanceReporter
from agent.instances.table import InstanceTable
from agent.workers.supervisor import Supervisor
from runtime.fleet_contract.tasks import StopInstance

log = logging.getLogger(__name__)

#: What an agent reports of a worker that is gone: after either, the control plane has been told.
_GONE_STATES = frozenset({"failed", "stopped"})


class InstanceListing(Protocol):
    """What the comparison needs of the control plane: its list of the node's instances, and a wait for its
    next answer that casts doubt on the workers (agent/control_plane_client.py's ``doubt``)."""

    async def list_instances(self) -> list[AgentInstance]: ...

    async def doubt(self) -> str: ...


class OwnershipChecks:
    """Compares the workers with the control plane's list (``run()`` repeatedly, ``compare()`` once) and stops,
    through ``stop``, those it disowns; owns when the next comparison is due."""

    def __init__(
        self,
        *,
        node: str,
        client: InstanceListing,
        instances: InstanceTable,
        supervisor: Supervisor,
        reports: InstanceReporter,
        stop: Callable[[StopInstance], Awaitable[None]],
        reconcile_s: float,
        listing_lag_s: float,
        adapters: AdapterFiles | None = None,
    ) -> None:
        self._node = node
        self._client = client
        self._instances = instances
        self._supervisor = supervisor
        self._reports = reports
        self._stop = stop
        self._reconcile_s = reconcile_s
        self._listing_lag_s = listing_lag_s
        self._adapters = adapters  # their files of pipelines no worker here runs are deleted after each comparison
        self._recheck_s: float | None = None  # set: compare again after this long, not ``reconcile_s``
        self._recheck_context = ""  # and why the comparison that asked for it was made

    async def run(self) -> None:
        """Compare the workers with the control plane's list every ``reconcile_s``, and at once when one of its
        answers casts doubt on them (it answers again after an outage, it refused a report)."""
        while True:
            # A worker kept only because its start was too recent for the list is looked at again soon.
            wait_s, self._recheck_s = self._recheck_s or self._reconcile_s, None
            try:
                async with asyncio.timeout(wait_s):
                    context = await self._client.doubt()
            except TimeoutError:
                periodic = f"found by the comparison with the control plane every {self._reconcile_s:g} s"
                context = self._recheck_context or periodic
            self._recheck_context = ""
            try:
                await self.compare(context)
            except TokenRejected:
                return  # the client's ``rejected`` tells the main loop, which stops the agent
            except Exception:
                # One bad round must not end the comparisons: a partition's orphans would then outlive it.
                log.exception("comparing the workers with the control plane failed; trying again later")

    async def compare(self, context: str) -> None:
        """Stop the workers that the control plane's list of this node's instances disowns, logging why and
        ``context`` (what prompted the comparison). A list that cannot be had changes nothing: a control
        plane that does not answer is no reason to stop anything.

        Raises TokenRejected.
        """
        accepted, asked_at = self._instances.starts_accepted, time.monotonic()
        try:
            rows = await self._client.list_instances()
        except ControlPlaneUnreachable as exc:
            log.debug("cannot compare the workers with the control plane now: %s", exc)
            return
        except ControlPlaneRefused as exc:
            log.warning("cannot compare the workers with the control plane: %s", exc)
            return
        await self.stop_disowned(rows, accepted, asked_at, context)
        self.report_missing(rows, accepted, asked_at, context)
        if self._adapters is not None:
            in_use = {AdapterFiles.key(pipeline, pipeline_id) for pipeline, pipeline_id in self._supervisor.pipelines()}
            await asyncio.to_thread(self._adapters.forget_unused, in_use, time.time())

    async def stop_disowned(self, rows: list[AgentInstance], accepted: int, asked_at: float, context: str) -> None:
        """Stop the workers ``rows`` disowns, of those started (or starting) before start number ``accepted``
        (a start accepted since the list was asked for, at ``asked_at``, may be missing from it)."""
        workers: dict[int, Started] = {}
        recent = set()
        for instance_id, entry in self._instances.items():
            if entry.accepted > accepted or entry.stopping:
                continue  # too new for this list, or being stopped already
            if entry.underway or self._supervisor.status(instance_id) is not None:
                workers[instance_id] = Started(entry.attempt, entry.incarnation)
                if entry.accepted and entry.accepted_at > asked_at - self._listing_lag_s:
                    recent.add(instance_id)
        if recent - {row.id for row in rows}:
            self._recheck_s, self._recheck_context = self._listing_lag_s, context
        for verdict in disowned(workers, rows, recent=recent):
            log.warning("%s (%s): stopping its worker", verdict.why, context)
            if not verdict.awaits_stop:
                self._reports.mark_disowned(verdict.instance_id)
            await self._stop(StopInstance(instance_id=verdict.instance_id, reason=verdict.why))

    def report_missing(self, rows: list[AgentInstance], accepted: int, asked_at: float, context: str) -> None:
        """Tell the control plane of each instance ``rows`` has running (or stopping) on this node that has no
        worker here and no operation under way: one that runs is reported failed (it is then restarted), one
        that stops is reported stopped. Instances started since the list was asked for (start number above
        ``accepted``, or accepted within ``listing_lag_s`` of ``asked_at``) and those already reported gone are
        left alone. This is what catches a worker lost without a word: a report that never arrived, a worker
        stopped by a task the agent should not have taken."""
        for row in rows:
            entry = self._instances.get(row.id)
            if self._supervisor.status(row.id) is not None:
                continue
            if entry is not None:
                recent = entry.accepted and entry.accepted_at > asked_at - self._listing_lag_s
                told = entry.last_report is not None and entry.last_report.state in _GONE_STATES
                if entry.underway or entry.accepted > accepted or recent or told:
                    continue
            if row.state == "stopping":
                log.info("instance %d: the control plane has it stopping and nothing runs here (%s)", row.id, context)
                self._reports.report(row.id, self._named(row, InstanceReport(state="stopped")))
            elif row.state in RUNNING_STATES:
                reason = f"no worker of this instance runs on node {self._node} (it was {row.state}; {context})"
                log.warning("instance %d: %s", row.id, reason)
                self._reports.report(row.id, self._named(row, InstanceReport(state="failed", reason=reason)))

    @staticmethod
    def _named(row: AgentInstance, report: InstanceReport) -> InstanceReport:
        """``report`` about the start the control plane's row is at (its attempt and incarnation)."""
        return msgspec.structs.replace(report, attempt=row.attempt, incarnation=row.incarnation)
