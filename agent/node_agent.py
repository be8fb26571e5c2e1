"""The node agent's main loop: the node's inventory to the control plane, the control plane's tasks to workers.

::

    register ──► heartbeat every N s (the inventory; simulated GPUs' memory used follows the workers)
        │
        ├──► adopt the workers a previous agent left running, and reconcile with the control plane:
        │    those it no longer wants are stopped, instances it thinks run here but do not are failed
        │
        ├──► compare the workers with the control plane's list of the node's instances every
        │    ``reconcile_s``, when it answers again after an outage, and when it refuses a report
        │    (403/404/409): the workers it disowns (agent/ownership.py) are stopped; a list that cannot
        │    be had changes nothing
        │
        └──► tasks from the node's queue (agent/task_consumer.py):
               start: download (progress reported) ──► launch ──► starting ──► ready | failed
               stop:  drain, terminate, kill ──► stopped
               log tail: the worker log's last lines

Every outcome reaches the control plane as a state report (agent/control_plane_client.py), never as a
task's result. The control plane decides restarts: the supervisor never restarts a worker, so a worker
that ends unasked is reported failed with why (its exit, its log's last lines), and the control plane
starts it again, with a higher ``attempt``, after its own backoff.

Tasks are idempotent. A start of an instance at the attempt it runs (or is starting) at only reports
its state again; a start at a newer attempt replaces the worker; one at an older attempt is ignored.
A stop of an instance not running here reports it stopped. The operations on one instance run one
after another: a stop cancels a start still downloading, a newer start waits for a stop in progress.
Each worker's attempt is kept in ``state_dir`` beside its record, so an agent that restarts knows it.
"""

import asyncio
import logging
import os
import time
from collections.abc import Callable, Collection, Coroutine, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgspec

from agent.control_plane_client import (
    CONTROL_PLANE_RETRY_JITTER,
    AgentInstance,
    ControlPlaneClient,
    ControlPlaneRefused,
    ControlPlaneUnreachable,
    DownloadReport,
    HeartbeatReply,
    InstanceReport,
    NodeNotRegistered,
    NodeReport,
    TokenRejected,
    node_report,
)
from agent.downloads import DownloadProgress, ModelDownloader
from agent.errors import DiskFull, DownloadError, HubUnreachable, WorkerError
from agent.gpu_check import GpuMismatch, check_gpus, named_by_uuid
from agent.inventory import Inventory
from agent.machine_identity import local_machine_id
from agent.ownership import disowned
from agent.processes import EXIT_CONFIG
from agent.readiness import RegistrationWatch
from agent.supervisor import Readiness, Supervisor, WorkerState, WorkerStatus
from agent.task_consumer import TaskConsumer
from agent.worker_spec import DEFAULT_COMMAND, allowed_environment
from runtime.backoff import Backoff
from runtime.discovery import Discovery
from runtime.engine_names import engines_on_this_node
from runtime.errors import BackgroundTaskFailed, ConfigError
from runtime.fleet_tasks import LocalSource, LogTailRequest, ModelSource, StartInstance, StopInstance
from runtime.task_signing import agent_signing_key

log = logging.getLogger(__name__)

#: Instance states in which the control plane expects a process of the instance on its node.
_RUNNING_STATES = frozenset({"downloading", "starting", "ready"})


class ControlPlane(Protocol):
    """What the agent needs of the control plane (agent/control_plane_client.py's ControlPlaneClient)."""

    async def register(self, report: NodeReport) -> None: ...

    async def heartbeat(self, report: NodeReport) -> HeartbeatReply | None: ...

    async def list_instances(self) -> list[AgentInstance]: ...

    async def doubt(self) -> str: ...

    def report_instance(self, instance_id: int, report: InstanceReport) -> None: ...

    def report_download(self, model_id: int, report: DownloadReport) -> None: ...

    async def flush(self, timeout_s: float) -> bool: ...


class ReadinessWhenConnected:
    """A worker's readiness, from the registration watch once etcd answers (until then, nobody is ready).

    The agent does not wait for etcd to register its node, heartbeat or take tasks: only readiness needs it.
    """

    def __init__(self) -> None:
        self._watch: asyncio.Future[Readiness] = asyncio.get_running_loop().create_future()

    def connected(self, readiness: Readiness) -> None:
        if not self._watch.done():
            self._watch.set_result(readiness)

    async def wait_registered(self, pid: int, labels: Mapping[str, str]) -> int:
        # Shielded: one waiter being cancelled (its worker stopped) must not cancel the future for all.
        readiness = await asyncio.shield(self._watch)
        return await readiness.wait_registered(pid, labels)


@dataclass(eq=False)
class _Instance:
    """What the agent knows of one instance."""

    #: The control plane's attempt this node runs or ran; None when unknown (adopted without a record).
    attempt: int | None
    #: The latest operation (a start or a stop); the next one waits for it.
    operation: "asyncio.Task[None] | None" = field(default=None, repr=False)
    #: Whether ``operation`` is a start (which a stop or a newer start cancels, if it is still under way).
    starting: bool = False
    #: The last report sent about it, sent again when a duplicate start asks.
    last_report: InstanceReport | None = None
    #: Which start this agent accepted last (a count): a list asked for before it may not show it yet.
    accepted: int = 0
    #: When (time.monotonic()) it was accepted.
    accepted_at: float = 0.0


class NodeAgent:
    """One node's agent: give it to a TaskConsumer as its handler; ``start()``, then ``close()``."""

    def __init__(
        self,
        *,
        node: str,
        client: ControlPlane,
        downloader: ModelDownloader,
        inventory: Inventory,
        readiness: Readiness,
        state_dir: Path,
        log_dir: Path,
        heartbeat_s: float = 5.0,
        worker_command: Sequence[str] = DEFAULT_COMMAND,
        worker_env: Mapping[str, str] | None = None,
        stop_timeout_s: float = 30.0,
        version: str = "",
        address: str = "",
        machine_id: str = "",
        reconcile_s: float = 30.0,
        listing_lag_s: float = 5.0,
        engines: Collection[str] | None = None,
    ) -> None:
        """``worker_env`` is the workers' environment (default: the agent's own); every ``reconcile_s`` the
        workers are compared with the control plane's list, which may not show a start sent less than
        ``listing_lag_s`` before (its transaction not committed yet). ``engines``, reported with the node's
        inventory, are those its workers can run (default: the fleet's engines installed here)."""
        self.node = node
        self.state_dir = state_dir
        self._client = client
        self._downloader = downloader
        self._inventory = inventory
        self._heartbeat_s = heartbeat_s
        self._reconcile_s = reconcile_s
        self._listing_lag_s = listing_lag_s
        self._recheck_s: float | None = None  # set: compare again after this long, not ``reconcile_s``
        self._recheck_context = ""  # and why the comparison that asked for it was made
        self._version = version
        self._address = address
        self._machine_id = machine_id
        self.engines = frozenset(engines_on_this_node() if engines is None else engines)
        self.supervisor = Supervisor(
            node=node,
            state_dir=state_dir,
            log_dir=log_dir,
            readiness=readiness,
            # The control plane decides restarts (with its own backoff): a worker that ends is reported.
            on_status=self._on_worker_status,
            command=worker_command,
            stop_timeout_s=stop_timeout_s,
            base_env=worker_env,
        )
        self._instances: dict[int, _Instance] = {}
        # Instances whose worker is being replaced by a newer attempt: its "stopped" is not news.
        self._replacing: set[int] = set()
        # Instances whose worker is stopped because the control plane disowns them, and which it does not
        # want a "stopped" of (it would refuse it: the instance is another node's, failed, or newer).
        self._disowned: set[int] = set()
        self._starts_accepted = 0
        self._model_ids: dict[int, int] = {}  # instance id -> the control plane's model id (download reports)
        self._tasks: set[asyncio.Task[None]] = set()

    # -- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Register the node (retrying while the control plane does not answer), then heartbeat, adopt the
        workers left running, and reconcile them with the control plane in the background.

        Raises TokenRejected, ConfigError (not the control plane's URL), ControlPlaneRefused.
        """
        await self._client.register(await self.node_report())
        self._spawn(self._heartbeats(), name="heartbeats")
        adopted = await self.supervisor.adopt()
        for instance_id in adopted:
            self._instances[instance_id] = _Instance(attempt=self._load_attempt(instance_id))
        self._forget_attempts(keep=set(adopted))
        if adopted:
            log.info("adopted %d running worker(s): instances %s", len(adopted), ", ".join(map(str, adopted)))
        self._spawn(self._reconcile(), name="reconcile with the control plane")
        self._spawn(self._compare_repeatedly(), name="compare the workers with the control plane")

    async def close(self, flush_s: float = 3.0) -> None:
        """Stop the agent's work and leave the workers running (the next agent adopts them); send the
        reports still queued if the control plane takes them within ``flush_s``."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.supervisor.close()
        if not await self._client.flush(flush_s):
            log.warning("stopping with reports the control plane has not taken: the next agent reports afresh")

    async def node_report(self) -> NodeReport:
        """The node's inventory now (simulated GPUs' memory used: what the workers on them declared)."""
        inventory = await asyncio.to_thread(self._inventory.read, self.supervisor.gpu_memory_in_use())
        return node_report(
            inventory,
            name=self.node,
            address=self._address,
            version=self._version,
            machine_id=self._machine_id,
            engines=self.engines,
        )

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_s)
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
                log.exception("a heartbeat failed; trying again in %.0f s", self._heartbeat_s)

    async def _reconcile(self) -> None:
        """Match the workers running here with what the control plane wants (after an agent restart)."""
        backoff = Backoff(1.0, 30.0, jitter=CONTROL_PLANE_RETRY_JITTER)
        while True:
            accepted, asked_at = self._starts_accepted, time.monotonic()
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
        self._model_ids.update({row.id: row.model.id for row in rows if row.model is not None})
        running = set(self.supervisor.instances())
        await self._stop_disowned(rows, accepted, asked_at, "found when the agent started")
        for row in rows:
            entry = self._instances.get(row.id)
            # Left alone: what runs here, what is under way, and what was reported already (a worker that
            # ended while no agent watched it was reported failed by the adoption, with its log's last lines).
            if row.id in running or (entry is not None and (self._busy(row.id, entry) or entry.last_report)):
                continue
            if row.state == "stopping":
                self._report(row.id, InstanceReport(state="stopped"))  # nothing runs here: the stop is done
            elif row.state in _RUNNING_STATES:
                self._report(
                    row.id,
                    InstanceReport(
                        state="failed",
                        reason=f"no worker of this instance runs on node {self.node} (it was {row.state} when the "
                        "agent restarted)",
                    ),
                )

    async def _compare_repeatedly(self) -> None:
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
        accepted, asked_at = self._starts_accepted, time.monotonic()
        try:
            rows = await self._client.list_instances()
        except ControlPlaneUnreachable as exc:
            log.debug("cannot compare the workers with the control plane now: %s", exc)
            return
        except ControlPlaneRefused as exc:
            log.warning("cannot compare the workers with the control plane: %s", exc)
            return
        await self._stop_disowned(rows, accepted, asked_at, context)

    async def _stop_disowned(self, rows: list[AgentInstance], accepted: int, asked_at: float, context: str) -> None:
        """Stop the workers ``rows`` disowns, of those started (or starting) before start number ``accepted``
        (a start accepted since the list was asked for, at ``asked_at``, may be missing from it)."""
        workers: dict[int, int | None] = {}
        recent = set()
        for instance_id, entry in self._instances.items():
            underway = entry.operation is not None and not entry.operation.done()
            if entry.accepted > accepted or (underway and not entry.starting):
                continue  # too new for this list, or being stopped already
            if underway or self.supervisor.status(instance_id) is not None:
                workers[instance_id] = entry.attempt
                if entry.accepted and entry.accepted_at > asked_at - self._listing_lag_s:
                    recent.add(instance_id)
        if recent - {row.id for row in rows}:
            self._recheck_s, self._recheck_context = self._listing_lag_s, context
        for verdict in disowned(workers, rows, recent=recent):
            log.warning("%s (%s): stopping its worker", verdict.why, context)
            if not verdict.awaits_stop:
                self._disowned.add(verdict.instance_id)
            await self.accept_stop(StopInstance(instance_id=verdict.instance_id, reason=verdict.why))

    # -- tasks (TaskHandler) --------------------------------------------------------------------------

    async def accept_start(self, request: StartInstance) -> None:
        """Start ``request``'s instance, unless this attempt (or a newer one) is here already; returns at once."""
        instance_id = request.spec.instance_id
        entry = self._instances.get(instance_id)
        if entry is not None and entry.attempt is not None and request.attempt < entry.attempt:
            log.info(
                "instance %d: ignoring a start of attempt %d (attempt %d is newer)",
                instance_id,
                request.attempt,
                entry.attempt,
            )
            return
        if entry is not None and entry.attempt is None and self._runs_unstopped(instance_id, entry):
            # A worker adopted without a record of its attempt: this start is taken to name it.
            entry.attempt = request.attempt
            self._save_attempt(instance_id, request.attempt)
        if (
            entry is not None
            and entry.attempt == request.attempt
            and (self._busy(instance_id, entry) or entry.last_report is not None)
        ):
            # A repeat (tasks may be delivered twice): what it asks for is under way, or done.
            log.info("instance %d: attempt %d is here already; reporting its state again", instance_id, entry.attempt)
            if entry.last_report is not None:
                self._client.report_instance(instance_id, entry.last_report)
            return
        if entry is None:
            entry = self._instances[instance_id] = _Instance(attempt=request.attempt)
        entry.attempt = request.attempt
        entry.last_report = None
        self._starts_accepted += 1
        entry.accepted, entry.accepted_at = self._starts_accepted, time.monotonic()
        self._disowned.discard(instance_id)
        self._save_attempt(instance_id, request.attempt)
        self._operate(instance_id, entry, lambda: self._start(request), starting=True)

    async def accept_stop(self, request: StopInstance) -> None:
        """Stop the instance's worker (or say it is stopped, if none runs here); returns at once."""
        entry = self._instances.setdefault(request.instance_id, _Instance(attempt=None))
        self._operate(request.instance_id, entry, lambda: self._stop(request), starting=False)

    async def log_tail(self, request: LogTailRequest) -> str:
        """The last lines of the instance's worker log. Raises WorkerError when this node has none."""
        return await asyncio.to_thread(self.supervisor.log_tail, request.instance_id, request.lines)

    async def refuse_start(self, instance_id: int, reason: str, attempt: int | None = None) -> None:
        """Report a start this node refused (agent/task_consumer.py checks them): the instance fails for good."""
        report = InstanceReport(
            state="failed", reason=f"refused by the agent: {reason}", attempt=attempt, permanent=True
        )
        self._report(instance_id, report)

    # -- operations -----------------------------------------------------------------------------------

    def _operate(
        self, instance_id: int, entry: _Instance, operation: Callable[[], Coroutine[Any, Any, None]], *, starting: bool
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
        entry.operation = self._spawn(after_previous(), name=f"{kind} instance {instance_id}")
        entry.starting = starting

    def _runs_unstopped(self, instance_id: int, entry: _Instance) -> bool:
        """Whether a worker runs here for the instance and no stop of it is under way."""
        stopping = entry.operation is not None and not entry.operation.done() and not entry.starting
        return not stopping and self.supervisor.status(instance_id) is not None

    def _busy(self, instance_id: int, entry: _Instance) -> bool:
        """Whether a worker runs here for the instance, or an operation on it is under way."""
        underway = entry.operation is not None and not entry.operation.done()
        return underway or self.supervisor.status(instance_id) is not None

    async def _start(self, request: StartInstance) -> None:
        spec = request.spec
        instance_id = spec.instance_id
        if self.supervisor.status(instance_id) is not None:
            log.info("instance %d: replacing its worker with attempt %d", instance_id, request.attempt)
            self._replacing.add(instance_id)
            try:
                await self.supervisor.stop(instance_id)
            finally:
                self._replacing.discard(instance_id)
        if request.source is not None:
            try:
                path = await self._fetch(instance_id, request.source)
            except DownloadError as exc:
                # A missing or forbidden repository, a bad local path: no retry fixes those. A hub that does
                # not answer, or a full disk, may be fine on the next try.
                permanent = not isinstance(exc, HubUnreachable | DiskFull)
                self._report(instance_id, InstanceReport(state="failed", reason=str(exc), permanent=permanent))
                return
            spec = msgspec.structs.replace(spec, model_path=str(path))
        if spec.gpu_indexes:
            inventory = await asyncio.to_thread(self._inventory.read, self.supervisor.gpu_memory_in_use())
            try:
                check_gpus(spec, inventory.gpus)
            except GpuMismatch as exc:
                log.warning("instance %d: not started: %s", instance_id, exc)
                self._report(instance_id, InstanceReport(state="failed", reason=f"cannot start the worker: {exc}"))
                return
            spec = named_by_uuid(spec, inventory.gpus)
        try:
            self.supervisor.start(spec)
        except (ConfigError, WorkerError) as exc:
            permanent = isinstance(exc, ConfigError)  # the spec itself is wrong: the same start fails again
            reason = f"cannot start the worker: {exc}"
            self._report(instance_id, InstanceReport(state="failed", reason=reason, permanent=permanent))

    async def _stop(self, request: StopInstance) -> None:
        await self.supervisor.stop(request.instance_id, timeout_s=request.grace_s)

    async def _fetch(self, instance_id: int, source: ModelSource) -> Path:
        """The model's local path; a hub download reports its progress. Raises DownloadError."""
        if isinstance(source, LocalSource):
            return await self._downloader.fetch(source)
        self._report(instance_id, InstanceReport(state="downloading", download_progress=0.0))
        model_id = await self._model_id(instance_id)
        last = DownloadProgress(0, None)

        def on_progress(progress: DownloadProgress) -> None:
            nonlocal last
            last = progress
            fraction = min(1.0, progress.bytes_done / progress.bytes_total) if progress.bytes_total else 0.0
            self._report(instance_id, InstanceReport(state="downloading", download_progress=fraction))
            if model_id is not None:
                self._client.report_download(
                    model_id,
                    DownloadReport(
                        state="downloading", bytes_done=progress.bytes_done, bytes_total=progress.bytes_total
                    ),
                )

        try:
            path = await self._downloader.fetch(source, on_progress)
        except DownloadError as exc:
            if model_id is not None:
                self._client.report_download(
                    model_id, DownloadReport(state="failed", bytes_done=last.bytes_done, error=str(exc))
                )
            raise
        if model_id is not None:
            total = last.bytes_total if last.bytes_total is not None else last.bytes_done
            self._client.report_download(model_id, DownloadReport(state="done", bytes_done=total, bytes_total=total))
        return path

    async def _model_id(self, instance_id: int) -> int | None:
        """The control plane's id of the instance's model (for download reports), if it can be learnt now."""
        if instance_id not in self._model_ids:
            try:
                rows = await self._client.list_instances()
            except (ControlPlaneUnreachable, ControlPlaneRefused) as exc:
                log.info("instance %d's download is not reported per model: %s", instance_id, exc)
                return None
            self._model_ids.update({row.id: row.model.id for row in rows if row.model is not None})
        return self._model_ids.get(instance_id)

    # -- reports --------------------------------------------------------------------------------------

    def _on_worker_status(self, status: WorkerStatus) -> None:
        instance_id = status.instance_id
        if status.state is WorkerState.STOPPING:
            return  # the control plane set "stopping" itself when it asked for the stop
        if status.state in (WorkerState.STOPPED, WorkerState.FAILED):
            self._forget_attempt(instance_id)
        if status.state is WorkerState.STOPPED:
            if instance_id in self._replacing:
                return
            if instance_id in self._disowned:
                # Not sent (the control plane would refuse it), but kept: a late repeat of the start is told.
                self._disowned.discard(instance_id)
                self._instances.setdefault(instance_id, _Instance(attempt=None)).last_report = InstanceReport(
                    state="stopped", reason=status.reason
                )
                return
            # The control plane's own reason for the stop (a scale-down, a drain) says more than ours.
            self._report(instance_id, InstanceReport(state="stopped"))
            return
        self._report(
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

    def _report(self, instance_id: int, report: InstanceReport) -> None:
        entry = self._instances.setdefault(instance_id, _Instance(attempt=None))
        if report.attempt is None and entry.attempt is not None:
            # Named, so that a report from a worker a newer attempt has replaced cannot pass for the new one's.
            report = msgspec.structs.replace(report, attempt=entry.attempt)
        entry.last_report = report
        # A download reports its progress every second or so: that is news only at debug level.
        level = logging.DEBUG if report.state == "downloading" and report.download_progress else logging.INFO
        log.log(level, "instance %d: %s%s", instance_id, report.state, f" ({report.reason})" if report.reason else "")
        self._client.report_instance(instance_id, report)

    # -- attempts on disk -----------------------------------------------------------------------------

    def _attempt_path(self, instance_id: int) -> Path:
        return self.state_dir / f"attempt-{instance_id}"

    def _save_attempt(self, instance_id: int, attempt: int) -> None:
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self._attempt_path(instance_id).write_text(str(attempt))
        except OSError as exc:
            log.warning("cannot record instance %d's attempt in %s (%s)", instance_id, self.state_dir, exc)

    def _load_attempt(self, instance_id: int) -> int | None:
        try:
            return int(self._attempt_path(instance_id).read_text())
        except (OSError, ValueError):
            return None

    def _forget_attempt(self, instance_id: int) -> None:
        self._attempt_path(instance_id).unlink(missing_ok=True)

    def _forget_attempts(self, *, keep: set[int]) -> None:
        for path in self.state_dir.glob("attempt-*"):
            number = path.name.removeprefix("attempt-")
            if not number.isdigit() or int(number) not in keep:
                path.unlink(missing_ok=True)

    # -- owned tasks ----------------------------------------------------------------------------------

    def _spawn(self, coroutine: Coroutine[Any, Any, None], *, name: str) -> "asyncio.Task[None]":
        task = asyncio.create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: "asyncio.Task[None]") -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("%s failed: %s", task.get_name(), error, exc_info=error)


@dataclass(frozen=True, kw_only=True)
class AgentSettings:
    """Everything ``flotilla agent`` was told (launcher/agent_command.py reads it from flags and variables)."""

    control_plane_url: str
    token: str
    node: str
    state_dir: Path
    models_dir: Path
    log_dir: Path
    broker_url: str
    simulated_gpus: list[int] | None = None
    heartbeat_s: float = 5.0
    reconcile_s: float = 30.0
    version: str = ""
    worker_command: Sequence[str] = DEFAULT_COMMAND
    stop_timeout_s: float = 30.0
    #: The machine id sent to the control plane; "" for this machine's own (agent/machine_identity.py).
    machine_id: str = ""


async def run_agent(settings: AgentSettings, stop: asyncio.Event) -> None:
    """Run the node's agent until ``stop`` is set; the workers keep running after it returns.

    Raises TokenRejected (the control plane refused the token), OtherMachine (another machine has the node's
    name), ConfigError (a setting it cannot use), ControlPlaneRefused, BackgroundTaskFailed (the task consumer
    died).
    """
    loop = asyncio.get_running_loop()
    machine = settings.machine_id or await asyncio.to_thread(local_machine_id, settings.state_dir)
    async with AsyncExitStack() as stack:
        inventory = Inventory(settings.simulated_gpus)
        stack.callback(inventory.close)
        client = await stack.enter_async_context(
            ControlPlaneClient(
                settings.control_plane_url,
                settings.token,
                node=settings.node,
                user_agent=f"flotilla-agent/{settings.version or 'dev'}",
            )
        )
        readiness = ReadinessWhenConnected()
        agent = NodeAgent(
            node=settings.node,
            client=client,
            downloader=ModelDownloader(settings.models_dir),
            inventory=inventory,
            readiness=readiness,
            state_dir=settings.state_dir,
            log_dir=settings.log_dir,
            heartbeat_s=settings.heartbeat_s,
            reconcile_s=settings.reconcile_s,
            worker_command=settings.worker_command,
            # What a worker may see of the agent's variables: never its token, the broker or HF_TOKEN.
            worker_env=allowed_environment(os.environ),
            stop_timeout_s=settings.stop_timeout_s,
            version=settings.version,
            machine_id=machine,
        )
        stack.push_async_callback(agent.close)
        if not await _unless_stopped(agent.start(), stop):
            log.info("stopped before the control plane at %s answered", settings.control_plane_url)
            return
        watching = asyncio.create_task(_watch_registrations(readiness), name="watch worker registrations in etcd")
        stack.push_async_callback(_cancel, watching)
        consumer = TaskConsumer(
            broker_url=settings.broker_url,
            node=settings.node,
            handler=agent,
            loop=loop,
            # Tasks signed for this node only: the broker's other clients (every agent) cannot forge them.
            signing_key=agent_signing_key(settings.token, settings.node),
            engines=agent.engines,  # the ones it reported: it refuses what it told the control plane it lacks
        )
        consumer.start()
        stack.push_async_callback(asyncio.to_thread, consumer.stop)
        log.info(
            "node %s's agent runs (state in %s, worker logs in %s)", settings.node, settings.state_dir, settings.log_dir
        )
        ended = asyncio.create_task(consumer.ended.wait())
        stopped = asyncio.create_task(stop.wait())
        waited: list[asyncio.Future[Any]] = [ended, stopped, client.rejected]
        try:
            await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            stopped.cancel()
        if client.rejected.done():
            raise client.rejected.result()
        if consumer.ended.is_set() and not stop.is_set():
            raise BackgroundTaskFailed(f"the Celery consumer of queue {consumer.queue} stopped (see the log above)")
        log.info("stopping the agent of node %s; its workers keep running", settings.node)


async def _watch_registrations(readiness: ReadinessWhenConnected) -> None:
    """Connect to etcd (waiting for it, with warnings), then watch the workers' registrations until cancelled."""
    async with await Discovery.connect() as discovery:
        watch = RegistrationWatch(discovery)
        watch.start()
        readiness.connected(watch)
        try:
            await asyncio.Event().wait()  # until cancelled
        finally:
            await watch.close()


async def _unless_stopped(coroutine: Coroutine[Any, Any, None], stop: asyncio.Event) -> bool:
    """Run ``coroutine`` unless ``stop`` is set first (it is then cancelled); whether it ran to the end."""
    task = asyncio.create_task(coroutine)
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if task.done():
        task.result()
        return True
    await _cancel(task)
    return False


async def _cancel(task: "asyncio.Task[Any]") -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
