"""The control plane's tasks as the node agent takes them from its queue (agent/tasks/consumer.py)::

    start: download (progress reported) ──► launch ──► starting ──► ready | failed
    stop:  drain, terminate, kill ──► stopped
    log tail: the worker log's last lines

Tasks are idempotent. A start of an instance at the attempt it runs (or is starting) at only reports
its state again; a start at a newer attempt replaces the worker; one at an older attempt is ignored.
A stop of an instance not running here reports it stopped; a stop of an older attempt is ignored. A
start or stop of another incarnation of the instance id (runtime/fleet_contract/tasks.py) is never taken
for this one's: a start replaces the worker whatever its attempt, a stop leaves it alone. The operations
on one instance run one after another: a stop cancels a start still downloading, a newer start waits for
a stop in progress.
A start's steps are agent/instances/start.py's. Each start is kept on disk until its worker is launched
(agent/instances/start_files.py), for an agent restarted meanwhile to resume it.
"""

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from agent.control_plane_client import InstanceReport
from agent.instances.reports import InstanceReporter
from agent.instances.start import InstanceStarter
from agent.instances.start_files import StartFiles
from agent.instances.table import InstanceEntry, InstanceTable
from agent.owned_tasks import OwnedTasks
from agent.workers.attempt_files import AttemptFiles
from agent.workers.supervisor import Supervisor
from runtime.fleet_contract.tasks import LogTailRequest, StartInstance, StopInstance

log = logging.getLogger(__name__)


class TaskIntake:
    """The agent's TaskHandler (agent/tasks/consumer.py): decides what each start or stop asks of this node,
    and runs each instance's operations one after another, in the background."""

    def __init__(
        self,
        *,
        instances: InstanceTable,
        supervisor: Supervisor,
        reports: InstanceReporter,
        attempts: AttemptFiles,
        starts: StartFiles,
        starter: InstanceStarter,
        tasks: OwnedTasks,
    ) -> None:
        self._instances = instances
        self._supervisor = supervisor
        self._reports = reports
        self._attempts = attempts
        self._starts = starts
        self._starter = starter
        self._tasks = tasks

    async def accept_start(self, request: StartInstance) -> None:
        """Start ``request``'s instance, unless this attempt (or a newer one) is here already; returns at once."""
        instance_id = request.spec.instance_id
        entry = self._instances.get(instance_id)
        if entry is not None and _other_incarnation(entry.incarnation, request.incarnation):
            # Not a newer or older start of the instance this node knows: another instance with its id (a
            # restored database). Whatever attempt each is at, the worker here is replaced.
            log.warning(
                "instance %d: a start of incarnation %s, but this node's worker is of incarnation %s (the control "
                "plane gave the id to a new instance): replacing it",
                instance_id,
                request.incarnation,
                entry.incarnation,
            )
        elif entry is not None and entry.attempt is not None and request.attempt < entry.attempt:
            log.info(
                "instance %d: ignoring a start of attempt %d (attempt %d is newer)",
                instance_id,
                request.attempt,
                entry.attempt,
            )
            return
        elif entry is not None and entry.attempt is None and self._runs_unstopped(instance_id, entry):
            # A worker adopted without a record of its attempt: this start is taken to name it.
            entry.attempt, entry.incarnation = request.attempt, request.incarnation
            self._attempts.save(instance_id, request.attempt, request.incarnation)
        if (
            entry is not None
            and not _other_incarnation(entry.incarnation, request.incarnation)
            and entry.attempt == request.attempt
            and (self.busy(instance_id, entry) or entry.last_report is not None)
        ):
            # A repeat (tasks may be delivered twice): what it asks for is under way, or done.
            log.info("instance %d: attempt %d is here already; reporting its state again", instance_id, entry.attempt)
            if entry.last_report is not None:
                self._reports.send_again(instance_id, entry.last_report)
            return
        if entry is None:
            entry = self._instances.add(instance_id, request.attempt, request.incarnation)
        entry.attempt, entry.incarnation = request.attempt, request.incarnation
        entry.last_report = None
        self._instances.count_start(entry)
        self._reports.clear_disowned(instance_id)
        self._attempts.save(instance_id, request.attempt, request.incarnation)
        self._starts.save(request)
        self._operate(instance_id, entry, lambda: self._start(request), starting=True)

    async def accept_stop(self, request: StopInstance) -> None:
        """Stop the instance's worker (or say it is stopped, if none runs here); returns at once.

        A stop names the start it stops: a worker of a newer attempt, or of another incarnation, is left
        alone (an old stop, delivered late or re-sent, must not stop what replaced its worker)."""
        instance_id = request.instance_id
        known = self._instances.get(instance_id)
        if known is not None and _other_incarnation(known.incarnation, request.incarnation):
            log.warning(
                "instance %d: a stop of incarnation %s leaves this node's worker of incarnation %s alone; "
                "nothing of the incarnation it names runs here",
                instance_id,
                request.incarnation,
                known.incarnation,
            )
            stopped = InstanceReport(state="stopped", attempt=request.attempt, incarnation=request.incarnation)
            self._reports.send_unkept(instance_id, stopped)
            return
        if (
            known is not None
            and known.attempt is not None
            and request.attempt is not None
            and request.attempt < known.attempt
        ):
            log.warning(
                "instance %d: ignoring a stop of attempt %d: this node runs attempt %d, which it does not name",
                instance_id,
                request.attempt,
                known.attempt,
            )
            return
        entry = self._instances.entry(instance_id)
        self._starts.forget(instance_id)  # a start it cancels is not to be resumed by the next agent
        self._operate(request.instance_id, entry, lambda: self._stop(request), starting=False)

    async def log_tail(self, request: LogTailRequest) -> str:
        """The last lines of the instance's worker log. Raises WorkerError when this node has none."""
        return await asyncio.to_thread(self._supervisor.log_tail, request.instance_id, request.lines)

    async def refuse_start(self, instance_id: int, reason: str, attempt: int | None = None) -> None:
        """Report a start this node refused (agent/tasks/consumer.py checks them): the instance fails for good."""
        report = InstanceReport(
            state="failed", reason=f"refused by the agent: {reason}", attempt=attempt, permanent=True
        )
        self._reports.report(instance_id, report)

    def busy(self, instance_id: int, entry: InstanceEntry) -> bool:
        """Whether a worker runs here for the instance, or an operation on it is under way."""
        return entry.underway or self._supervisor.status(instance_id) is not None

    def _runs_unstopped(self, instance_id: int, entry: InstanceEntry) -> bool:
        """Whether a worker runs here for the instance and no stop of it is under way."""
        return not entry.stopping and self._supervisor.status(instance_id) is not None

    def _operate(
        self,
        instance_id: int,
        entry: InstanceEntry,
        operation: Callable[[], Coroutine[Any, Any, None]],
        *,
        starting: bool,
    ) -> None:
        """Run ``operation`` once the instance's previous one is done; a start still under way is cancelled."""
        previous = entry.operation
        if previous is not None and not previous.done() and entry.starting:
            previous.cancel()

        async def after_previous() -> None:
            if previous is not None:
                await asyncio.wait([previous])
            await operation()

        kind = "start" if starting else "stop"
        entry.operation = self._tasks.spawn(after_previous(), name=f"{kind} instance {instance_id}")
        entry.starting = starting

    async def _start(self, request: StartInstance) -> None:
        try:
            await self._starter.start(request)
        except asyncio.CancelledError:
            # A stop or a newer start cancelled it, and removed or replaced its file; or the agent stops, and
            # the file stays for the next agent to resume the start.
            raise
        except BaseException:
            self._starts.forget_start(request)
            raise
        # Launched (the worker's record takes over), or failed and reported: nothing to resume.
        self._starts.forget_start(request)

    async def _stop(self, request: StopInstance) -> None:
        await self._supervisor.stop(request.instance_id, timeout_s=request.grace_s)


def _other_incarnation(known: str, named: str) -> bool:
    """Whether a task naming incarnation ``named`` is about another instance than the entry of ``known``
    (either unknown: no, as from agents and control planes that did not record one)."""
    return bool(known and named and known != named)
