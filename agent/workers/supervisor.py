"""The agent's engine workers: launched as child processes, watched, stopped, and adopted.

Each worker (agent/workers/spec.py) runs ``flotilla run in=dyn://… out=<engine> …`` in its own session,
with ``CUDA_VISIBLE_DEVICES`` set to its GPUs and its output appended to ``<log_dir>/instance-<id>.log``.
Every state change goes to ``on_status`` as a WorkerStatus::

    starting ──► ready ──► stopping ──► stopped
        │          │
        └────┬─────┘
             ▼
          failed (reason, exit code or signal)

Readiness is the worker's registration in etcd (agent/workers/readiness.py). A worker that ends without being
asked is reported failed, once what it left behind has been ended too (agent/workers/processes.py), with how
it ended (exit code or signal) and its log's last lines, and forgotten: the supervisor never starts it again
itself. The control plane decides restarts (it starts the instance again, after its own backoff); the agent
reports exit code 2 (EXIT_CONFIG, bad configuration) as a permanent failure, since a restart would fail the
same way.

The supervisor survives its own restart: each running worker has a record in ``state_dir``
(agent/workers/records.py); ``adopt()`` in a new supervisor takes over the workers still running,
without killing them, and reports those that ended meanwhile as failed. ``close()`` stops supervising
and leaves the workers running, for the next agent to adopt; ``stop()`` stops one for good.
"""

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Protocol

import msgspec

from agent.errors import WorkerError
from agent.workers.processes import ExitStatus, WorkerProcess, boot_id, describe_exit, end_leftovers, log_tail
from agent.workers.records import WorkerRecord, load_records, remove_record, save_record
from agent.workers.spec import DEFAULT_COMMAND, allowed_environment, worker_argv, worker_env
from agent.workers.worker_user import WorkerUser
from runtime.fleet_contract.signing import SigningKey
from runtime.fleet_contract.tasks import WorkerSpec
from runtime.process_tree import DEFAULT_GRACE_S

log = logging.getLogger(__name__)

#: Lines of a worker's log quoted in the reason of its failure.
REASON_LOG_LINES = 20


class WorkerState(StrEnum):
    """The instance states an agent reports (the control plane's names)."""

    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


class WorkerStatus(msgspec.Struct, frozen=True, kw_only=True):
    """One state change of a worker, as the agent reports it to the control plane."""

    instance_id: int
    state: WorkerState
    reason: str = ""
    pid: int | None = None
    #: The worker's instance id in etcd, once it is ready.
    endpoint_instance_id: int | None = None
    exit_code: int | None = None
    exit_signal: int | None = None


StatusCallback = Callable[[WorkerStatus], None]


class Readiness(Protocol):
    """Tells when a worker process can take requests (agent/workers/readiness.py: its etcd registration)."""

    async def wait_registered(self, pid: int, labels: Mapping[str, str]) -> int:
        """Wait until the worker ``pid`` with ``labels`` is registered; return its endpoint instance id."""
        ...


@dataclass(eq=False)
class _Worker:
    spec: WorkerSpec
    log_path: Path
    process: WorkerProcess | None = None
    endpoint_instance_id: int | None = None
    state: WorkerState = WorkerState.STARTING
    task: "asyncio.Task[None] | None" = field(default=None, repr=False)
    stopping: "asyncio.Task[None] | None" = field(default=None, repr=False)


class Supervisor:
    """Runs this node's engine workers. One per agent; ``close()`` (or ``stop_all()``) when done."""

    def __init__(
        self,
        *,
        node: str,
        state_dir: Path,
        log_dir: Path,
        readiness: Readiness,
        on_status: StatusCallback,
        command: Sequence[str] = DEFAULT_COMMAND,
        stop_timeout_s: float = 30.0,
        leftover_grace_s: float = DEFAULT_GRACE_S,
        base_env: Mapping[str, str] | None = None,
        node_key: SigningKey | None = None,
        worker_user: WorkerUser | None = None,
    ) -> None:
        """``command`` starts ``flotilla``; ``stop_timeout_s`` is how long a stopping worker may drain
        before it is killed (more than its FLOTILLA_DRAIN_S); ``leftover_grace_s`` is how long the processes
        an ended worker left behind may take to end on SIGTERM before they are killed; ``base_env`` is the
        environment the workers' is made from (agent/workers/spec.py), by default the agent's own variables
        that a worker may see; ``node_key`` is the node's task-signing key, from which each worker gets its own
        instance's worker key (none without it: a worker then obeys any fence and claims no liveness);
        ``worker_user`` is the user they run as (agent/workers/worker_user.py; None: the agent's)."""
        self.node = node
        self.state_dir = state_dir
        self.log_dir = log_dir
        self.stop_timeout_s = stop_timeout_s
        self.leftover_grace_s = leftover_grace_s
        self._readiness = readiness
        self._on_status = on_status
        self._command = tuple(command)
        self._base_env = allowed_environment(os.environ) if base_env is None else dict(base_env)
        self._node_key = node_key
        self._worker_user = worker_user
        self._workers: dict[int, _Worker] = {}
        self._boot_id = boot_id()

    # -- what the agent's main loop calls ------------------------------------------------------------

    def start(self, spec: WorkerSpec) -> None:
        """Start supervising ``spec``'s worker; its states arrive through ``on_status``.

        Idempotent: a worker already running with the same spec is left alone (tasks may be delivered
        twice). Raises ConfigError for a spec whose names cannot make a command line, WorkerError when
        the instance already runs with another spec or is being stopped.
        """
        current = self._workers.get(spec.instance_id)
        if current is not None:
            if current.stopping is not None:
                raise WorkerError(f"instance {spec.instance_id} is being stopped: start it again once it has stopped")
            if current.spec == spec:
                return
            raise WorkerError(f"instance {spec.instance_id} already runs here with another spec: stop it first")
        worker_argv(spec, self.node, self._command)  # refuse a bad spec now, not in the task
        worker = _Worker(spec, self.log_path(spec.instance_id))
        self._supervise(worker, adopted=None)

    async def stop(self, instance_id: int, *, timeout_s: float | None = None) -> None:
        """Stop the worker gracefully: SIGTERM (it drains), then SIGKILL after ``timeout_s``; report stopped.

        Idempotent: an instance not running here is reported stopped at once.
        """
        worker = self._workers.get(instance_id)
        if worker is None:
            remove_record(self.state_dir, instance_id)
            self._emit(WorkerStatus(instance_id=instance_id, state=WorkerState.STOPPED, reason="not running here"))
            return
        if worker.stopping is None:
            worker.stopping = asyncio.create_task(self._stop(worker, timeout_s), name=f"stop instance {instance_id}")
        # A second stop() waits for the first; cancelling a caller does not leave a worker half stopped.
        await asyncio.shield(worker.stopping)

    async def _stop(self, worker: _Worker, timeout_s: float | None) -> None:
        if worker.task is not None:
            worker.task.cancel()
            await asyncio.wait([worker.task])
        process = worker.process
        self._set(worker, WorkerState.STOPPING, pid=process.pid if process else None)
        status = ExitStatus()
        if process is not None:
            status = await self._terminate(process, self.stop_timeout_s if timeout_s is None else timeout_s)
            worker.process = None
        instance_id = worker.spec.instance_id
        remove_record(self.state_dir, instance_id)
        self._workers.pop(instance_id, None)
        self._set(
            worker, WorkerState.STOPPED, reason="stopped by the agent", exit_code=status.code, exit_signal=status.signal
        )

    async def stop_all(self, *, timeout_s: float | None = None) -> None:
        """Stop every worker (a node being drained for good), all at once."""
        await asyncio.gather(*(self.stop(instance, timeout_s=timeout_s) for instance in list(self._workers)))

    async def adopt(self) -> list[int]:
        """Take over the workers a previous agent left running; returns the instance ids adopted.

        A recorded worker that is no longer running is reported failed (with its log's last lines), once what
        it left behind has been ended, and forgotten: the control plane decides whether to start it again.
        """
        adopted = []
        for record in load_records(self.state_dir):
            instance_id = record.spec.instance_id
            if instance_id in self._workers:
                continue
            log_path = Path(record.log_path)
            process = WorkerProcess.adopt(record.pid, record.start_time, record.boot_id, record.tree_mark)
            if process is None:
                if record.boot_id == self._boot_id:  # after a reboot nothing of it runs
                    await end_leftovers(record.pid, record.start_time, record.tree_mark, self.leftover_grace_s)
                remove_record(self.state_dir, instance_id)
                reason = await self._reason(
                    f"the worker (pid {record.pid}) ended while the agent was not watching it", log_path
                )
                self._emit(WorkerStatus(instance_id=instance_id, state=WorkerState.FAILED, reason=reason))
                continue
            worker = _Worker(record.spec, log_path, process=process, endpoint_instance_id=record.endpoint_instance_id)
            log.info("adopted the worker of instance %d (pid %d)", instance_id, process.pid)
            self._supervise(worker, adopted=process)
            adopted.append(instance_id)
        return adopted

    async def close(self) -> None:
        """Stop supervising and leave the workers running (their records stay, for ``adopt()``)."""
        tasks = [worker.task for worker in self._workers.values() if worker.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._workers.clear()

    def status(self, instance_id: int) -> WorkerState | None:
        """The worker's current state, or None if it is not supervised here."""
        worker = self._workers.get(instance_id)
        return worker.state if worker else None

    def instances(self) -> list[int]:
        """The instance ids supervised here."""
        return list(self._workers)

    def pipelines(self) -> set[tuple[str, int]]:
        """The (pipeline namespace, pipeline id) of every worker supervised here."""
        return {(worker.spec.pipeline, worker.spec.pipeline_id) for worker in self._workers.values()}

    def gpu_memory_in_use(self) -> dict[int, int]:
        """Bytes the running workers declared per GPU index (what simulated GPUs report as used)."""
        used: dict[int, int] = {}
        for worker in self._workers.values():
            if worker.process is None:
                continue
            for index in worker.spec.gpu_indexes:
                used[index] = used.get(index, 0) + worker.spec.gpu_memory_bytes
        return used

    def log_path(self, instance_id: int) -> Path:
        return self.log_dir / f"instance-{instance_id}.log"

    def log_tail(self, instance_id: int, lines: int = 100) -> str:
        """The last ``lines`` lines of the instance's log (kept after it ended). Blocking: a small read.

        Raises WorkerError when this node has no log of that instance.
        """
        path = self.log_path(instance_id)
        if not path.exists():
            raise WorkerError(f"instance {instance_id} has no log on node {self.node}")
        return log_tail(path, lines)

    # -- supervision -------------------------------------------------------------------------------

    def _supervise(self, worker: _Worker, *, adopted: WorkerProcess | None) -> None:
        self._workers[worker.spec.instance_id] = worker
        worker.task = asyncio.create_task(
            self._run(worker, adopted), name=f"supervise instance {worker.spec.instance_id}"
        )

    async def _run(self, worker: _Worker, adopted: WorkerProcess | None) -> None:
        try:
            await self._run_once(worker, adopted)
        except Exception as exc:
            # A bug or a full disk here must not leave the instance looking alive: say so, once.
            log.exception("supervising instance %d failed", worker.spec.instance_id)
            await self._fail(worker, f"the agent could not supervise the worker: {type(exc).__name__}: {exc}")

    async def _run_once(self, worker: _Worker, adopted: WorkerProcess | None) -> None:
        """Run the worker until it ends, then report it failed (unless this task is cancelled by stop() or
        close() first). Never started again here: the control plane decides that."""
        process = adopted
        if process is None:
            try:
                process = self._launch(worker)
            except OSError as exc:
                await self._fail(worker, f"cannot start the worker: {exc}")
                return
        started = time.monotonic()
        status = await self._watch(worker, process)
        worker.process = None
        reason = await self._reason(f"the worker {describe_exit(status)}", worker.log_path)
        log.warning("instance %d: %s (after %.1f s)", worker.spec.instance_id, reason, time.monotonic() - started)
        await self._fail(worker, reason, status)

    def _launch(self, worker: _Worker) -> WorkerProcess:
        """Spawn the worker and record it. Synchronous on purpose: fork and exec take milliseconds, and no
        cancellation can then fall between the spawn and the record (which would lose the process).
        Raises OSError."""
        spec = worker.spec
        worker.log_path.parent.mkdir(parents=True, exist_ok=True)
        with worker.log_path.open("ab") as log_file:
            log_file.write(f"--- flotilla agent: starting instance {spec.instance_id} ---\n".encode())
        process = WorkerProcess.spawn(
            worker_argv(spec, self.node, self._command),
            worker_env(spec, self._base_env, self._node_key),
            worker.log_path,
            user=self._worker_user,
        )
        worker.process = process
        worker.endpoint_instance_id = None
        try:
            self._save(worker)
        except OSError:
            process.kill()
            raise
        self._set(worker, WorkerState.STARTING, pid=process.pid)
        return process

    async def _watch(self, worker: _Worker, process: WorkerProcess) -> ExitStatus:
        """Wait for the process to end, reporting it ready meanwhile; how it ended."""
        exited = asyncio.create_task(
            process.wait(kill_leftovers=True, grace_s=self.leftover_grace_s), name=f"wait for pid {process.pid}"
        )
        labels = {"instance": str(worker.spec.instance_id), "node": self.node}
        registered = asyncio.create_task(self._readiness.wait_registered(process.pid, labels))
        try:
            await asyncio.wait([exited, registered], return_when=asyncio.FIRST_COMPLETED)
            if registered.done() and not exited.done():
                if (error := registered.exception()) is not None:
                    log.error("instance %d: readiness cannot be watched: %s", worker.spec.instance_id, error)
                else:
                    worker.endpoint_instance_id = registered.result()
                    self._save(worker)
                    self._set(worker, WorkerState.READY, pid=process.pid)
            return await exited
        finally:
            registered.cancel()
            exited.cancel()
            await asyncio.gather(registered, exited, return_exceptions=True)

    async def _fail(self, worker: _Worker, reason: str, status: ExitStatus | None = None) -> None:
        """Report the worker failed and forget it (its process, if any, is killed)."""
        status = status or ExitStatus()
        if worker.process is not None:
            worker.process.kill()
            worker.process = None
        remove_record(self.state_dir, worker.spec.instance_id)
        self._workers.pop(worker.spec.instance_id, None)
        self._set(worker, WorkerState.FAILED, reason=reason, exit_code=status.code, exit_signal=status.signal)

    async def _terminate(self, process: WorkerProcess, timeout_s: float) -> ExitStatus:
        """SIGTERM, wait up to ``timeout_s`` for the drain, then SIGKILL the whole group."""
        process.terminate()
        waiting = asyncio.create_task(process.wait(kill_leftovers=True, grace_s=self.leftover_grace_s))
        try:
            return await asyncio.wait_for(asyncio.shield(waiting), timeout_s)
        except TimeoutError:
            log.warning("worker pid %d did not stop within %.0f s of SIGTERM: killing it", process.pid, timeout_s)
            process.kill()
            return await waiting

    async def _reason(self, what: str, log_path: Path) -> str:
        tail = await asyncio.to_thread(log_tail, log_path, REASON_LOG_LINES)
        return f"{what}; the last lines of its log ({log_path}):\n{tail}" if tail else what

    def _save(self, worker: _Worker) -> None:
        process = worker.process
        if process is None:
            return
        save_record(
            self.state_dir,
            WorkerRecord(
                spec=worker.spec,
                pid=process.pid,
                start_time=process.start_time,
                boot_id=self._boot_id,
                log_path=str(worker.log_path),
                endpoint_instance_id=worker.endpoint_instance_id,
                tree_mark=process.mark,
            ),
        )

    def _set(
        self,
        worker: _Worker,
        state: WorkerState,
        *,
        reason: str = "",
        pid: int | None = None,
        exit_code: int | None = None,
        exit_signal: int | None = None,
    ) -> None:
        worker.state = state
        self._emit(
            WorkerStatus(
                instance_id=worker.spec.instance_id,
                state=state,
                reason=reason,
                pid=pid,
                endpoint_instance_id=worker.endpoint_instance_id if state is WorkerState.READY else None,
                exit_code=exit_code,
                exit_signal=exit_signal,
            )
        )

    def _emit(self, status: WorkerStatus) -> None:
        try:
            self._on_status(status)
        except Exception:
            log.exception("the status callback failed on %s", status)
