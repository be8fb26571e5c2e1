"""The node agent's main loop: the node's inventory to the control plane, the control plane's tasks to workers.

::

    register ──► heartbeat every N s (the inventory; simulated GPUs' memory used follows the workers)
        │                                                                    agent/heartbeats.py
        │
        ├──► adopt the workers a previous agent left running, and reconcile with the control plane:
        │    the starts it left under way (downloads) that the control plane still wants are resumed,
        │    workers it no longer wants are stopped, instances it thinks run here but do not are failed
        │                                                                    agent/instances/startup_reconcile.py
        │
        ├──► then compare the workers with the control plane's list of the node's instances every
        │    ``reconcile_s``, when it answers again after an outage, and when it refuses a report
        │    (403/404/409): the workers it disowns (agent/instances/ownership.py) are stopped; a list that cannot
        │    be had changes nothing                                          agent/instances/ownership_checks.py
        │
        └──► tasks from the node's queue (agent/tasks/consumer.py)            agent/tasks/intake.py
               start: download (progress reported) ──► launch ──► starting ──► ready | failed
               stop:  drain, terminate, kill ──► stopped
               log tail: the worker log's last lines

Each of those is its module's; NodeAgent builds the parts, wires them together, and starts and stops
them. The parts share what the agent knows of each instance (agent/instances/table.py); every outcome
reaches the control plane as a state report through agent/instances/reports.py, never as a task's result
(the control plane decides restarts). A start's steps are agent/instances/start.py's, its download's
reports agent/reported_downloads.py's; each worker's attempt is kept on disk by agent/workers/attempt_files.py,
each start until its worker is launched by agent/instances/start_files.py; the background tasks are
agent/owned_tasks.py's.

``run_agent`` runs a NodeAgent as the ``flotilla agent`` process, with the control plane's client, the
etcd watch that tells when workers are ready, and the broker's task consumer.
"""

import asyncio
import logging
import os
from collections.abc import Collection, Coroutine, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from agent.adapter_files import AdapterFiles
from agent.control_plane_client import ControlPlaneClient, NodeReport
from agent.downloads import ModelDownloader
from agent.heartbeats import Heartbeats, NodeRegistry
from agent.instances.ownership_checks import InstanceListing, OwnershipChecks
from agent.instances.reports import InstanceReporter, InstanceReportSink
from agent.instances.start import InstanceStarter
from agent.instances.start_files import StartFiles
from agent.instances.startup_reconcile import StartupReconciliation
from agent.instances.table import InstanceTable
from agent.inventory import Inventory
from agent.machine_identity import local_machine_id
from agent.owned_tasks import OwnedTasks
from agent.reported_downloads import DownloadReportSink, ReportedDownloads
from agent.tasks.consumer import TaskConsumer
from agent.tasks.intake import TaskIntake
from agent.workers.attempt_files import AttemptFiles
from agent.workers.readiness import RegistrationWatch
from agent.workers.spec import DEFAULT_COMMAND, allowed_environment
from agent.workers.supervisor import Readiness, Supervisor
from agent.workers.worker_user import WorkerUser, share_models_dir
from runtime.cluster.discovery import Discovery
from runtime.errors import BackgroundTaskFailed
from runtime.fleet_contract.engine_names import engines_on_this_node
from runtime.fleet_contract.signing import SigningKey, agent_signing_key
from runtime.fleet_contract.tasks import LogTailRequest, SetAdapters, StartInstance, StopInstance

log = logging.getLogger(__name__)


class ControlPlane(NodeRegistry, InstanceReportSink, DownloadReportSink, InstanceListing, Protocol):
    """What the agent needs of the control plane (agent/control_plane_client.py's ControlPlaneClient): what
    each of its parts needs, and a last flush of the queued reports when it stops."""

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


class NodeAgent:
    """One node's agent: give it to a TaskConsumer as its handler; ``start()``, then ``close()``.

    The one place where the agent's parts are built and wired: each owns its topic (see the module's
    docstring), and the tasks it takes go to the task intake.
    """

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
        signing_key: SigningKey | None = None,
        worker_user: WorkerUser | None = None,
    ) -> None:
        """``worker_env`` is the workers' environment (default: the agent's own); every ``reconcile_s`` the
        workers are compared with the control plane's list, which may not show a start sent less than
        ``listing_lag_s`` before (its transaction not committed yet). ``engines``, reported with the node's
        inventory, are those its workers can run (default: the fleet's engines installed here). ``signing_key``
        is the node's task-signing key, from which each worker gets its instance's worker key (none without it)."""
        self.node = node
        self.state_dir = state_dir
        self.engines = frozenset(engines_on_this_node() if engines is None else engines)
        self._client = client
        self._tasks = OwnedTasks()
        instances = InstanceTable()
        attempts = AttemptFiles(state_dir)
        starts = StartFiles(state_dir)
        reports = InstanceReporter(client, instances, attempts)
        self.supervisor = Supervisor(
            node=node,
            state_dir=state_dir,
            log_dir=log_dir,
            readiness=readiness,
            # The control plane decides restarts (with its own backoff): a worker that ends is reported.
            on_status=reports.on_worker_status,
            command=worker_command,
            stop_timeout_s=stop_timeout_s,
            base_env=worker_env,
            node_key=signing_key,
            worker_user=worker_user,
        )
        self._heartbeats = Heartbeats(
            client=client,
            inventory=inventory,
            gpu_memory_in_use=self.supervisor.gpu_memory_in_use,
            node=node,
            address=address,
            version=version,
            machine_id=machine_id,
            engines=self.engines,
            interval_s=heartbeat_s,
            adapter_failures=lambda: self.adapters.failures(),
        )
        downloads = ReportedDownloads(client, downloader, reports.report)
        self.adapters = AdapterFiles(downloader)
        self._intake = TaskIntake(
            instances=instances,
            supervisor=self.supervisor,
            reports=reports,
            attempts=attempts,
            starts=starts,
            starter=InstanceStarter(self.supervisor, downloads, inventory, reports, self.adapters),
            tasks=self._tasks,
        )
        self._ownership = OwnershipChecks(
            node=node,
            client=client,
            instances=instances,
            supervisor=self.supervisor,
            reports=reports,
            stop=self._intake.accept_stop,
            reconcile_s=reconcile_s,
            listing_lag_s=listing_lag_s,
            adapters=self.adapters,
        )
        self._startup = StartupReconciliation(
            node=node,
            client=client,
            instances=instances,
            attempts=attempts,
            starts=starts,
            supervisor=self.supervisor,
            intake=self._intake,
            ownership=self._ownership,
            downloads=downloads,
            reports=reports,
        )

    # -- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Register the node (retrying while the control plane does not answer), then heartbeat, adopt the
        workers left running, and reconcile them with the control plane in the background.

        Raises TokenRejected, ConfigError (not the control plane's URL), ControlPlaneRefused.
        """
        await self._heartbeats.register()
        self._tasks.spawn(self._heartbeats.run(), name="heartbeats")
        await self._startup.adopt()
        self._tasks.spawn(self._reconcile_then_compare(), name="reconcile and compare with the control plane")

    async def _reconcile_then_compare(self) -> None:
        # The comparisons begin once the reconciliation has resumed the starts left under way: one before
        # would take a resumed download's instance for one with no worker here, and report it failed.
        await self._startup.reconcile()
        await self._ownership.run()

    async def close(self, flush_s: float = 3.0) -> None:
        """Stop the agent's work and leave the workers running (the next agent adopts them); send the
        reports still queued if the control plane takes them within ``flush_s``."""
        await self._tasks.cancel_all()
        await self.supervisor.close()
        if not await self._client.flush(flush_s):
            log.warning("stopping with reports the control plane has not taken: the next agent reports afresh")

    async def node_report(self) -> NodeReport:
        """The node's inventory now (simulated GPUs' memory used: what the workers on them declared)."""
        return await self._heartbeats.node_report()

    async def compare(self, context: str) -> None:
        """Stop the workers the control plane's list disowns (agent/instances/ownership_checks.py).

        Raises TokenRejected."""
        await self._ownership.compare(context)

    # -- tasks (TaskHandler: agent/tasks/intake.py) ----------------------------------------------------

    async def accept_start(self, request: StartInstance) -> None:
        await self._intake.accept_start(request)

    async def accept_stop(self, request: StopInstance) -> None:
        await self._intake.accept_stop(request)

    async def log_tail(self, request: LogTailRequest) -> str:
        return await self._intake.log_tail(request)

    async def refuse_start(self, instance_id: int, reason: str, attempt: int | None = None) -> None:
        await self._intake.refuse_start(instance_id, reason, attempt)

    async def set_adapters(self, request: SetAdapters) -> None:
        """Fetch the pipeline's adapters and write its adapter file, in the background (a download may take
        long; the task is re-sent, and a copy finds the set applied)."""
        self._tasks.spawn(
            self._apply_adapters(request), name=f"adapter set {request.generation} of pipeline {request.pipeline}"
        )

    async def _apply_adapters(self, request: SetAdapters) -> None:
        try:
            await self.adapters.apply(request.pipeline, request.adapters, request.generation, request.pipeline_id)
        except OSError as exc:
            log.warning("pipeline %s: cannot write its adapter file: %s", request.pipeline, exc)


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
    #: The user the workers run as when the agent is root (agent/workers/worker_user.py); None: the agent's.
    worker_user: WorkerUser | None = None


async def run_agent(settings: AgentSettings, stop: asyncio.Event) -> None:
    """Run the node's agent until ``stop`` is set; the workers keep running after it returns.

    Raises TokenRejected (the control plane refused the token), OtherMachine (another machine has the node's
    name), ConfigError (a setting it cannot use), ControlPlaneRefused, BackgroundTaskFailed (the task consumer
    died).
    """
    loop = asyncio.get_running_loop()
    machine = settings.machine_id or await asyncio.to_thread(local_machine_id, settings.state_dir)
    if (user := settings.worker_user) is not None:
        # Before any download: what it writes must be the workers' group's to read.
        await asyncio.to_thread(share_models_dir, settings.models_dir, user)
        log.info("engine workers run as user %s (uid %d), without access to the agent's token", user.name, user.uid)
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
        downloader = ModelDownloader(settings.models_dir)
        stack.push_async_callback(downloader.close)  # after the agent's close: its downloads' processes end
        readiness = ReadinessWhenConnected()
        # Tasks signed for this node only, and each worker's key derived from it (fences, liveness).
        signing_key = agent_signing_key(settings.token, settings.node)
        agent = NodeAgent(
            node=settings.node,
            client=client,
            downloader=downloader,
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
            signing_key=signing_key,
            worker_user=settings.worker_user,
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
            signing_key=signing_key,
            engines=agent.engines,  # the ones it reported: it refuses what it told the control plane it lacks
            control_plane_now=client.clock.now,  # tasks expire on the control plane's clock, not this node's
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
