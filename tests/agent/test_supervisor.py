"""The supervisor with tiny Python children standing in for `flotilla run`: start, a crash reported (never
restarted here: the control plane decides that), graceful stop, and adoption by a new supervisor after the
agent restarts.

The child is called as the supervisor calls `flotilla` (``CHILD run in=dyn://… out=ENGINE …``); its
"engine" says how it behaves. It signals readiness by connecting to a Unix socket, standing in for its
etcd registration (tests/agent/test_supervisor_workers.py checks readiness with real workers and etcd).
"""

import asyncio
import json
import os
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path

import msgspec
import pytest

from agent.errors import WorkerError
from agent.workers.processes import process_start_time
from agent.workers.records import WorkerRecord, load_records, record_path
from agent.workers.supervisor import Supervisor, WorkerState, WorkerStatus
from runtime.fleet_contract.signing import agent_signing_key
from runtime.fleet_contract.tasks import WorkerSpec
from runtime.fleet_contract.worker_keys import decode, worker_key

CHILD = """
import json, os, signal, socket, subprocess, sys

engine = next(arg[len("out="):] for arg in sys.argv if arg.startswith("out="))
print("argv:", " ".join(sys.argv[1:]))
print("CUDA_VISIBLE_DEVICES=" + os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"), flush=True)


def announce():
    with socket.socket(socket.AF_UNIX) as ready:
        ready.connect(os.environ["READY_SOCKET"])
        ready.sendall(b"%d\\n" % os.getpid())


def drain(signum, frame):
    print("draining", flush=True)
    sys.exit(0)


if engine == "crash":
    print("boom: the engine fell over", flush=True)
    sys.exit(3)
if engine == "environment":
    print("environment:", json.dumps(dict(os.environ)), flush=True)
    sys.exit(0)
if engine == "config":
    print("unknown key in --extra-engine-args", flush=True)
    sys.exit(2)
if engine == "serve":
    signal.signal(signal.SIGTERM, drain)
elif engine == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("grandchild", grandchild.pid, flush=True)
announce()
while True:
    signal.pause()
"""

GIB = 1 << 30


class SocketReadiness:
    """Readiness from the children's announcements on a Unix socket; like etcd, it outlives a supervisor."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.announced: set[int] = set()
        self.asked: list[tuple[int, dict[str, str]]] = []
        self._changed = asyncio.Condition()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._announcement, path=str(self.path))

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _announcement(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pid = int(await reader.readline())
        writer.close()
        async with self._changed:
            self.announced.add(pid)
            self._changed.notify_all()

    async def wait_registered(self, pid: int, labels: Mapping[str, str]) -> int:
        self.asked.append((pid, dict(labels)))
        async with self._changed:
            await self._changed.wait_for(lambda: pid in self.announced)
        return pid * 10


class Statuses:
    """What the supervisor reported, awaited one by one."""

    def __init__(self) -> None:
        self.seen: list[WorkerStatus] = []
        self._queue: asyncio.Queue[WorkerStatus] = asyncio.Queue()

    def __call__(self, status: WorkerStatus) -> None:
        self.seen.append(status)
        self._queue.put_nowait(status)

    async def nothing_more(self, wait_s: float = 0.2) -> None:
        """No status follows within ``wait_s`` (a worker that ended is not started again)."""
        await asyncio.sleep(wait_s)
        assert self.pending() == []

    async def next(self, state: WorkerState | None = None) -> WorkerStatus:
        """The next status (which must be in ``state``, when given)."""
        async with asyncio.timeout(30):
            status = await self._queue.get()
        if state is not None:
            assert status.state is state, f"expected {state}, got {status}"
        return status

    def pending(self) -> list[WorkerStatus]:
        drained = []
        while not self._queue.empty():
            drained.append(self._queue.get_nowait())
        return drained


@pytest.fixture
def child(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "child.py"
    path.write_text(CHILD)
    yield path
    kill_recorded_workers(tmp_path / "state")


def kill_recorded_workers(state_dir: Path) -> None:
    """End the workers a failed test left running (a closed supervisor leaves them on purpose)."""
    for record in load_records(state_dir):
        if process_start_time(record.pid) == record.start_time:
            os.killpg(record.pid, signal.SIGKILL)


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    # Unix socket paths are short (108 bytes): pytest's tmp_path may be too long.
    with tempfile.TemporaryDirectory(prefix="flotilla-") as directory:
        yield Path(directory)


@pytest.fixture
async def readiness(socket_dir: Path) -> AsyncIterator[SocketReadiness]:
    ready = SocketReadiness(socket_dir / "ready.sock")
    await ready.start()
    yield ready
    await ready.close()


def make_supervisor(tmp_path: Path, child: Path, readiness: SocketReadiness, statuses: Statuses) -> Supervisor:
    return Supervisor(
        node="node-a",
        state_dir=tmp_path / "state",
        log_dir=tmp_path / "logs",
        readiness=readiness,
        on_status=statuses,
        command=[sys.executable, str(child)],
        stop_timeout_s=10,
        base_env={**os.environ, "READY_SOCKET": str(readiness.path)},
    )


def spec(instance_id: int, engine: str, **fields: object) -> WorkerSpec:
    return msgspec.convert(
        {"instance_id": instance_id, "pipeline": "p", "group": "aggregated", "replica": 0, "engine": engine, **fields},
        WorkerSpec,
    )


async def pid_gone(pid: int) -> None:
    """Wait for ``pid`` (not our child) to end, through a pidfd."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    ended = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_reader(fd, ended.set)
    try:
        async with asyncio.timeout(10):
            await ended.wait()
    finally:
        loop.remove_reader(fd)
        os.close(fd)


async def test_a_worker_starts_with_its_gpus_becomes_ready_and_stops_gracefully(
    tmp_path: Path, child: Path, readiness: SocketReadiness
) -> None:
    statuses = Statuses()
    supervisor = make_supervisor(tmp_path, child, readiness, statuses)
    supervisor.start(spec(7, "serve", gpu_indexes=[1, 3], gpu_memory_bytes=20 * GIB, model_path="/m.gguf"))
    starting = await statuses.next(WorkerState.STARTING)
    ready = await statuses.next(WorkerState.READY)
    assert starting.pid is not None
    assert ready.pid == starting.pid and ready.endpoint_instance_id == starting.pid * 10
    assert readiness.asked == [(starting.pid, {"instance": "7", "node": "node-a"})]
    assert supervisor.gpu_memory_in_use() == {1: 20 * GIB, 3: 20 * GIB}
    [record] = load_records(tmp_path / "state")
    assert (record.pid, record.endpoint_instance_id) == (starting.pid, starting.pid * 10)
    log = supervisor.log_tail(7)
    assert "CUDA_VISIBLE_DEVICES=1,3" in log
    assert "in=dyn://p.backend.generate out=serve /m.gguf --labels" in log

    await supervisor.stop(7)
    assert [(s.state, s.exit_code) for s in statuses.pending()] == [
        (WorkerState.STOPPING, None),
        (WorkerState.STOPPED, 0),  # it drained on SIGTERM and exited 0
    ]
    assert supervisor.log_tail(7, 1) == "draining"  # the log outlives the worker
    assert supervisor.gpu_memory_in_use() == {}
    assert load_records(tmp_path / "state") == []
    assert supervisor.instances() == []


async def test_a_crashing_worker_is_reported_failed_and_forgotten_not_restarted(
    tmp_path: Path, child: Path, readiness: SocketReadiness
) -> None:
    statuses = Statuses()
    supervisor = make_supervisor(tmp_path, child, readiness, statuses)
    supervisor.start(spec(8, "crash"))
    await statuses.next(WorkerState.STARTING)
    failed = await statuses.next(WorkerState.FAILED)
    assert failed.exit_code == 3
    assert "failed with exit code 3" in failed.reason
    assert "boom: the engine fell over" in failed.reason  # the log's last lines come with it
    assert supervisor.instances() == []
    assert load_records(tmp_path / "state") == []
    await statuses.nothing_more()  # the control plane decides whether it runs again


async def test_a_worker_that_refuses_its_configuration_is_not_restarted(
    tmp_path: Path, child: Path, readiness: SocketReadiness
) -> None:
    statuses = Statuses()
    supervisor = make_supervisor(tmp_path, child, readiness, statuses)
    supervisor.start(spec(9, "config"))
    await statuses.next(WorkerState.STARTING)
    failed = await statuses.next(WorkerState.FAILED)
    assert failed.exit_code == 2  # EXIT_CONFIG: the agent reports it as a permanent failure
    assert "restarting cannot help" in failed.reason and "unknown key" in failed.reason


async def test_a_killed_worker_is_reported_with_its_signal_and_runs_again_only_when_started_again(
    tmp_path: Path, child: Path, readiness: SocketReadiness
) -> None:
    statuses = Statuses()
    supervisor = make_supervisor(tmp_path, child, readiness, statuses)
    supervisor.start(spec(10, "serve"))
    first = await statuses.next(WorkerState.STARTING)
    await statuses.next(WorkerState.READY)
    assert first.pid is not None
    os.kill(first.pid, signal.SIGKILL)
    failed = await statuses.next(WorkerState.FAILED)
    assert failed.exit_signal == signal.SIGKILL and "out-of-memory" in failed.reason
    assert supervisor.instances() == [] and load_records(tmp_path / "state") == []
    await statuses.nothing_more()
    # The control plane's next start of the instance (a new attempt) runs a new worker.
    supervisor.start(spec(10, "serve"))
    second = await statuses.next(WorkerState.STARTING)
    assert second.pid != first.pid
    assert (await statuses.next(WorkerState.READY)).pid == second.pid
    await supervisor.stop(10)


def test_the_record_of_an_older_agent_with_its_restart_count_is_still_read(tmp_path: Path) -> None:
    record = WorkerRecord(spec=spec(5, "serve"), pid=4242, start_time=17, boot_id="boot", log_path="/logs/5.log")
    older = {**msgspec.to_builtins(record), "restarts": 0}  # the count older agents kept (always 0)
    path = record_path(tmp_path, 5)
    path.write_text(json.dumps(older))
    assert load_records(tmp_path) == [record]


async def test_a_worker_that_ignores_sigterm_is_killed_with_what_it_started(
    tmp_path: Path, child: Path, readiness: SocketReadiness
) -> None:
    statuses = Statuses()
    supervisor = make_supervisor(tmp_path, child, readiness, statuses)
    supervisor.start(spec(11, "stubborn"))
    await statuses.next(WorkerState.STARTING)
    await statuses.next(WorkerState.READY)
    grandchild = int(
        next(line for line in supervisor.log_tail(11).splitlines() if line.startswith("grandchild")).split()[1]
    )
    assert process_start_time(grandchild) is not None
    await supervisor.stop(11, timeout_s=0.5)
    stopped = statuses.pending()[-1]
    assert stopped.state is WorkerState.STOPPED and stopped.exit_signal == signal.SIGKILL
    await pid_gone(grandchild)  # its whole process group went with it


async def test_starting_or_stopping_twice_is_harmless_but_a_conflicting_start_is_refused(
    tmp_path: Path, child: Path, readiness: SocketReadiness
) -> None:
    statuses = Statuses()
    supervisor = make_supervisor(tmp_path, child, readiness, statuses)
    supervisor.start(spec(12, "serve"))
    supervisor.start(spec(12, "serve"))
    with pytest.raises(WorkerError, match="another spec"):
        supervisor.start(spec(12, "serve", replica=1))
    await statuses.next(WorkerState.STARTING)
    await statuses.next(WorkerState.READY)
    stops = [asyncio.create_task(supervisor.stop(12)), asyncio.create_task(supervisor.stop(12))]
    await asyncio.sleep(0)  # both stops have begun
    with pytest.raises(WorkerError, match="is being stopped"):
        supervisor.start(spec(12, "serve"))
    await asyncio.gather(*stops)
    assert [s.state for s in statuses.pending()] == [WorkerState.STOPPING, WorkerState.STOPPED]  # stopped once
    await supervisor.stop(12)  # again: nothing runs, it is reported stopped
    assert (await statuses.next(WorkerState.STOPPED)).reason == "not running here"
    with pytest.raises(WorkerError, match="no log"):
        supervisor.log_tail(99)


async def test_a_new_supervisor_adopts_running_workers_and_reports_vanished_ones(
    tmp_path: Path, child: Path, readiness: SocketReadiness
) -> None:
    before = Statuses()
    old = make_supervisor(tmp_path, child, readiness, before)
    old.start(spec(20, "serve"))
    old.start(spec(21, "serve"))
    pids = {}
    for _ in range(4):
        status = await before.next()
        pids[status.instance_id] = status.pid
    assert {status.state for status in before.seen} == {WorkerState.STARTING, WorkerState.READY}
    await old.close()  # the agent restarts: its workers keep running
    assert all(process_start_time(pid) is not None for pid in pids.values() if pid)
    # Instance 21 dies while no agent watches.
    vanished = pids[21]
    assert vanished is not None
    os.kill(vanished, signal.SIGKILL)
    await pid_gone(vanished)

    after = Statuses()
    new = make_supervisor(tmp_path, child, readiness, after)
    assert await new.adopt() == [20]
    ready, failed = sorted([await after.next(), await after.next()], key=lambda status: status.instance_id)
    assert failed.state is WorkerState.FAILED and failed.instance_id == 21
    assert "ended while the agent was not watching it" in failed.reason
    assert ready.state is WorkerState.READY
    kept = pids[20]
    assert kept is not None
    assert (ready.instance_id, ready.pid, ready.endpoint_instance_id) == (20, kept, kept * 10)
    assert [record.spec.instance_id for record in load_records(tmp_path / "state")] == [20]

    # Not its parent, it still notices the adopted worker's death, and reports it.
    adopted_pid = pids[20]
    assert adopted_pid is not None
    os.kill(adopted_pid, signal.SIGKILL)
    failed = await after.next(WorkerState.FAILED)
    assert failed.instance_id == 20 and failed.exit_code is None and "exit code is unknown" in failed.reason
    assert new.instances() == [] and load_records(tmp_path / "state") == []
    await after.nothing_more()


async def test_a_worker_sees_none_of_the_agents_credentials_only_what_it_needs_to_serve(
    tmp_path: Path, child: Path, readiness: SocketReadiness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The agent's own environment, as systemd gives it (deploy/systemd/env/agent.env and the token file).
    agents = {
        "FLOTILLA_BROKER_URL": "redis://:fleet-password@127.0.0.1:6379/0",
        "FLOTILLA_AGENT_TOKEN_FILE": "/etc/flotilla/agent.token",
        "FLOTILLA_AGENT_TOKEN": "flt_agent_secret",
        "FLOTILLA_CONTROL_PLANE": "http://127.0.0.1:8000",
        "HF_TOKEN": "hf_secret",
        "FLOTILLA_THREADS": "64",
        "ETCD_ENDPOINTS": "http://127.0.0.1:2379",
        "NATS_SERVER": "nats://127.0.0.1:4222",
        "FLOTILLA_DRAIN_S": "3",
        "FLOTILLA_WORKER_KEY": "1:" + "ab" * 32,  # another worker's, were it there: never passed on
    }
    for name, value in agents.items():
        monkeypatch.setenv(name, value)
    statuses = Statuses()
    node_key = agent_signing_key(agents["FLOTILLA_AGENT_TOKEN"], "node-a")
    supervisor = Supervisor(
        node="node-a",
        state_dir=tmp_path / "state",
        log_dir=tmp_path / "logs",
        readiness=readiness,
        on_status=statuses,
        command=[sys.executable, str(child)],
        node_key=node_key,
    )
    supervisor.start(spec(4, "environment", gpu_indexes=[2]))
    await statuses.next(WorkerState.STARTING)
    await statuses.next(WorkerState.FAILED)  # it printed its environment and ended
    line = next(line for line in supervisor.log_tail(4, 20).splitlines() if line.startswith("environment: "))
    seen = json.loads(line.removeprefix("environment: "))
    for secret in ("FLOTILLA_BROKER_URL", "FLOTILLA_AGENT_TOKEN_FILE", "FLOTILLA_AGENT_TOKEN", "HF_TOKEN"):
        assert secret not in seen
    assert "FLOTILLA_CONTROL_PLANE" not in seen and "FLOTILLA_THREADS" not in seen
    for needed in ("ETCD_ENDPOINTS", "NATS_SERVER", "FLOTILLA_DRAIN_S"):
        assert seen[needed] == agents[needed]
    assert seen["PATH"] == os.environ["PATH"]
    assert (seen["CUDA_VISIBLE_DEVICES"], seen["CUDA_DEVICE_ORDER"]) == ("2", "PCI_BUS_ID")
    assert decode(seen["FLOTILLA_WORKER_KEY"]) == worker_key(node_key, 4)  # its own instance's key only
