"""The instances' state reports to the control plane, and what each change of a worker's state becomes.

Every outcome reaches the control plane as a state report (agent/control_plane_client.py), never as a
task's result. The control plane decides restarts: the supervisor never restarts a worker, so a worker
that ends unasked is reported failed with why (its exit, its log's last lines), and the control plane
starts it again, with a higher ``attempt``, after its own backoff.

Two "stopped" are not news and are not sent: that of a worker being replaced by a newer attempt of its
instance, and that of a worker the control plane disowns (it would refuse the report: the instance is
another node's, failed, or newer); the latter is kept, so that a late repeat of the start is told.
"""

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import msgspec

from agent.control_plane_client import InstanceReport
from agent.instances.table import InstanceTable
from agent.workers.attempt_files import AttemptFiles
from agent.workers.processes import EXIT_CONFIG
from agent.workers.supervisor import WorkerState, WorkerStatus

log = logging.getLogger(__name__)


class InstanceReportSink(Protocol):
    """Where instance reports go (the control plane's client, which queues them while it is away)."""

    def report_instance(self, instance_id: int, report: InstanceReport) -> None: ...


class InstanceReporter:
    """Sends the instances' reports, each named by the attempt (and incarnation) its instance is at, and keeps each
    instance's last one; turns the supervisor's WorkerStatus changes into reports (``on_worker_status``)."""

    def __init__(self, client: InstanceReportSink, instances: InstanceTable, attempts: AttemptFiles) -> None:
        self._client = client
        self._instances = instances
        self._attempts = attempts
        # Instances whose worker is being replaced by a newer attempt: its "stopped" is not news.
        self._replacing: set[int] = set()
        # Instances whose worker is stopped because the control plane disowns them, and which it does not
        # want a "stopped" of (it would refuse it: the instance is another node's, failed, or newer).
        self._disowned: set[int] = set()

    def report(self, instance_id: int, report: InstanceReport) -> None:
        """Send ``report``, named by the instance's attempt unless it names one, and keep it as the last."""
        entry = self._instances.entry(instance_id)
        if report.attempt is None and entry.attempt is not None:
            # Named, so that a report from a worker a newer attempt has replaced cannot pass for the new one's.
            report = msgspec.structs.replace(report, attempt=entry.attempt)
        if not report.incarnation and entry.incarnation:
            # And a report from another incarnation's worker (a restored database reused the id) for this one's.
            report = msgspec.structs.replace(report, incarnation=entry.incarnation)
        entry.last_report = report
        # A download reports its progress every second or so: that is news only at debug level.
        level = logging.DEBUG if report.state == "downloading" and report.download_progress else logging.INFO
        log.log(level, "instance %d: %s%s", instance_id, report.state, f" ({report.reason})" if report.reason else "")
        self._client.report_instance(instance_id, report)

    def send_unkept(self, instance_id: int, report: InstanceReport) -> None:
        """Send a report about another start than the one the instance's entry is of (it names its own
        attempt and incarnation): the entry's last report stays what it was."""
        log.info("instance %d: %s (incarnation %s)", instance_id, report.state, report.incarnation or "not said")
        self._client.report_instance(instance_id, report)

    def send_again(self, instance_id: int, report: InstanceReport) -> None:
        """Send a report already sent (and kept) once more, as it is, for a start delivered twice."""
        self._client.report_instance(instance_id, report)

    @contextmanager
    def replacing(self, instance_id: int) -> Iterator[None]:
        """While the instance's worker is stopped to make way for a newer attempt: its "stopped" is not sent."""
        self._replacing.add(instance_id)
        try:
            yield
        finally:
            self._replacing.discard(instance_id)

    def mark_disowned(self, instance_id: int) -> None:
        """The control plane disowns the instance and wants no "stopped" of its worker: keep it, unsent."""
        self._disowned.add(instance_id)

    def clear_disowned(self, instance_id: int) -> None:
        """The instance was started again here: its worker's "stopped" is news again."""
        self._disowned.discard(instance_id)

    def on_worker_status(self, status: WorkerStatus) -> None:
        """The supervisor's ``on_status``: report the worker's new state, if it is news to the control plane."""
        instance_id = status.instance_id
        if status.state is WorkerState.STOPPING:
            return  # the control plane set "stopping" itself when it asked for the stop
        if status.state in (WorkerState.STOPPED, WorkerState.FAILED):
            self._attempts.forget(instance_id)
        if status.state is WorkerState.STOPPED:
            if instance_id in self._replacing:
                return
            if instance_id in self._disowned:
                # Not sent (the control plane would refuse it), but kept: a late repeat of the start is told.
                self._disowned.discard(instance_id)
                self._instances.entry(instance_id).last_report = InstanceReport(state="stopped", reason=status.reason)
                return
            # The control plane's own reason for the stop (a scale-down, a drain) says more than ours.
            self.report(instance_id, InstanceReport(state="stopped"))
            return
        self.report(
            instance_id,
            InstanceReport(
                state=status.state.value,
                reason=status.reason,
                pid=status.pid,
                endpoint_instance_id=status.endpoint_instance_id,
                # Exit code 2 is a usage error (a bad flag, an unknown engine argument): it fails every time.
                permanent=status.state is WorkerState.FAILED and status.exit_code == EXIT_CONFIG,
            ),
        )
