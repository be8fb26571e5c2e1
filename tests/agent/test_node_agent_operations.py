"""The node agent's handling of starts, stops and restarts, with tiny Python children as its workers (the
ones tests/agent/test_supervisor.py uses) and a stand-in control plane that records the reports.

It shows the agent's decisions: idempotent starts by attempt, replacement by a newer attempt, failures
reported (never restarted by the agent), and, after the agent restarts, adoption and reconciliation."""

import asyncio
import contextlib
import os
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest

from agent.control_plane_client import (
    AgentInstance,
    AgentModel,
    ControlPlaneUnreachable,
    DownloadReport,
    InstanceReport,
    NodeReport,
)
from agent.downloads import ModelDownloader
from agent.inventory import Inventory
from agent.node_agent import NodeAgent
from agent.workers.processes import process_start_time
from runtime.fleet_contract.engine_names import engines_on_this_node
from runtime.fleet_contract.tasks import LocalSource, LogTailRequest, StartInstance, StopInstance, WorkerSpec
from tests.agent.test_supervisor import CHILD, SocketReadiness, kill_recorded_workers, pid_gone

pytestmark = pytest.mark.timeout(60)

GIB = 1 << 30


class StandInControlPlane:
    """Records what the agent tells the control plane; ``instances`` is what it answers when asked (unless
    ``unreachable``); ``doubts`` is what its answers cast doubt with."""

    def __init__(self) -> None:
        self.registered: list[NodeReport] = []
        self.instances: list[AgentInstance] = []
        self.downloads: list[tuple[int, DownloadReport]] = []
        self.unreachable = False
        #: How many times the agent asked for the list of instances; ``asked`` is set each time.
        self.listed = 0
        self.asked = asyncio.Event()
        self.doubts: asyncio.Queue[str] = asyncio.Queue()
        self._reports: asyncio.Queue[tuple[int, InstanceReport]] = asyncio.Queue()

    async def register(self, report: NodeReport) -> None:
        self.registered.append(report)

    async def heartbeat(self, report: NodeReport) -> None:
        return None

    async def list_instances(self) -> list[AgentInstance]:
        self.listed += 1
        self.asked.set()
        if self.unreachable:
            raise ControlPlaneUnreachable("cannot reach the control plane at http://stand-in (ConnectError)")
        return self.instances

    async def doubt(self) -> str:
        return await self.doubts.get()

    def report_instance(self, instance_id: int, report: InstanceReport) -> None:
        self._reports.put_nowait((instance_id, report))

    def report_download(self, model_id: int, report: DownloadReport) -> None:
        self.downloads.append((model_id, report))

    async def flush(self, timeout_s: float) -> bool:
        return True

    async def next(self) -> tuple[int, InstanceReport]:
        async with asyncio.timeout(30):
            return await self._reports.get()

    async def next_state(self, instance_id: int, state: str) -> InstanceReport:
        """The next report, which must be about ``instance_id`` and in ``state``."""
        reported_id, report = await self.next()
        assert (reported_id, report.state) == (instance_id, state), report
        return report

    def pending(self) -> list[tuple[int, InstanceReport]]:
        drained = []
        while not self._reports.empty():
            drained.append(self._reports.get_nowait())
        return drained


@pytest.fixture
def child(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "child.py"
    path.write_text(CHILD)
    yield path
    kill_recorded_workers(tmp_path / "state")


@pytest.fixture
async def readiness() -> AsyncIterator[SocketReadiness]:
    # Unix socket paths are short: pytest's tmp_path may be too long.
    with tempfile.TemporaryDirectory(prefix="flotilla-") as directory:
        ready = SocketReadiness(Path(directory) / "ready.sock")
        await ready.start()
        yield ready
        await ready.close()


def make_agent(
    tmp_path: Path,
    child: Path,
    readiness: SocketReadiness,
    control_plane: StandInControlPlane,
    *,
    reconcile_s: float = 3600,
    listing_lag_s: float = 5.0,
) -> NodeAgent:
    return NodeAgent(
        node="node-a",
        client=control_plane,
        downloader=ModelDownloader(tmp_path / "models"),
        inventory=Inventory([24 * GIB, 24 * GIB]),
        readiness=readiness,
        state_dir=tmp_path / "state",
        log_dir=tmp_path / "logs",
        heartbeat_s=3600,
        worker_command=[sys.executable, str(child)],
        worker_env={**os.environ, "READY_SOCKET": str(readiness.path)},
        stop_timeout_s=10,
        reconcile_s=reconcile_s,
        listing_lag_s=listing_lag_s,
    )


@contextlib.asynccontextmanager
async def started_agent(
    tmp_path: Path, child: Path, readiness: SocketReadiness, control_plane: StandInControlPlane, **settings: float
) -> AsyncIterator[NodeAgent]:
    """``make_agent``'s agent, started; its workers stopped and the agent closed at the end."""
    agent = make_agent(tmp_path, child, readiness, control_plane, **settings)
    await agent.start()
    try:
        yield agent
    finally:
        await agent.supervisor.stop_all()
        await agent.close()


async def ready_after_starting(control_plane: StandInControlPlane, instance_id: int) -> InstanceReport:
    """The instance's next two reports, "starting" then "ready"; the latter."""
    await control_plane.next_state(instance_id, "starting")
    return await control_plane.next_state(instance_id, "ready")


def start(instance_id: int, engine: str = "serve", attempt: int = 0, **fields: object) -> StartInstance:
    spec = msgspec.convert(
        {"instance_id": instance_id, "pipeline": "p", "group": "aggregated", "replica": 0, "engine": engine, **fields},
        WorkerSpec,
    )
    return StartInstance(spec=spec, attempt=attempt)


def launches(tmp_path: Path, instance_id: int) -> int:
    """How many times the instance's worker was launched (the child prints its argv once per run)."""
    return (tmp_path / "logs" / f"instance-{instance_id}.log").read_text().count("argv:")


async def test_a_start_reports_starting_then_ready_and_a_repeat_of_it_only_reports_again(
    tmp_path: Path, child: Path, readiness: SocketReadiness
) -> None:
    control_plane = StandInControlPlane()
    agent = make_agent(tmp_path, child, readiness, control_plane)
    await agent.start()
    try:
        await agent.accept_start(start(1, gpu_indexes=[1], gpu_memory_bytes=3 * GIB))
        starting = await control_plane.next_state(1, "starting")
        ready = await control_plane.next_state(1, "ready")
        assert ready.pid == starting.pid and ready.endpoint_instance_id == (starting.pid or 0) * 10

        await agent.accept_start(start(1, gpu_indexes=[1], gpu_memory_bytes=3 * GIB))
        assert await control_plane.next() == (1, ready)
        assert launches(tmp_path, 1) == 1

        # The simulated GPU's memory used is what the worker on it declared.
        report = await agent.node_report()
        assert [gpu.memory_used_bytes for gpu in report.gpus] == [0, 3 * GIB]
        assert "argv:" in await agent.log_tail(LogTailRequest(instance_id=1, lines=5))
    finally:
        await agent.supervisor.stop_all()
        await agent.close()


async def test_the_agent_reports_the_engines_its_workers_can_run_and_refuses_the_others(
    tmp_path: Path, child: Path, readiness: SocketReadiness
) -> None:
    control_plane = StandInControlPlane()
    agent = make_agent(tmp_path, child, readiness, control_plane)
    assert agent.engines == engines_on_this_node()
    await agent.start()
    try:
        [registered] = control_plane.registered
        assert registered.engines == sorted(engines_on_this_node())
        assert {"mocker", "echo_core", "echo_full"} <= set(registered.engines)  # no package to install for these
        assert (await agent.node_report()).engines == registered.engines  # and every heartbeat
    finally:
        await agent.close()

    chosen = NodeAgent(
        node="node-a",
        client=control_plane,
        downloader=ModelDownloader(tmp_path / "models"),
        inventory=Inventory([]),
        readiness=readiness,
        state_dir=tmp_path / "state-2",
        log_dir=tmp_path / "logs-2",
        engines={"mocker"},
    )
    assert (await chosen.node_report()).engines == ["mocker"]


async def test_a_newer_attempt_replaces_the_worker_and_an_older_one_is_ignored(
    tmp_path: Path, child: Path, readiness: SocketReadiness
) -> None:
    control_plane = StandInControlPlane()
    agent = make_agent(tmp_path, child, readiness, control_plane)
    await agent.start()
    try:
        await agent.accept_start(start(2, attempt=1))
        await control_plane.next_state(2, "starting")
        first = await control_plane.next_state(2, "ready")

        await agent.accept_start(start(2, attempt=2))
        # No "stopped" in between: the instance is being restarted, not stopped.
        second = await control_plane.next_state(2, "starting")
        assert second.pid != first.pid and first.pid is not None
        await pid_gone(first.pid)
        await control_plane.next_state(2, "ready")

        await agent.accept_start(start(2, attempt=1))  # overtaken by attempt 2: nothing happens
        await agent.accept_stop(StopInstance(instance_id=2, grace_s=5))
        await control_plane.next_state(2, "stopped")  # the next news is the stop's
        assert launches(tmp_path, 2) == 2
    finally:
        await agent.close()


async def test_a_stop_of_an_instance_not_running_here_reports_it_stopped_and_a_later_start_runs_it(
    tmp_path: Path, child: Path, readiness: SocketReadiness
) -> None:
    control_plane = StandInControlPlane()
    agent = make_agent(tmp_path, child, readiness, control_plane)
    await agent.start()
    try:
        await agent.accept_stop(StopInstance(instance_id=9))
        assert await control_plane.next() == (9, InstanceReport(state="stopped"))
        await agent.accept_start(start(9, attempt=1))  # restarted by the control plane
        await control_plane.next_state(9, "starting")
        await control_plane.next_state(9, "ready")
    finally:
        await agent.supervisor.stop_all()
        await agent.close()


async def test_a_worker_that_fails_is_reported_with_why_and_not_restarted(
    tmp_path: Path, child: Path, readiness: SocketReadiness
) -> None:
    control_plane = StandInControlPlane()
    agent = make_agent(tmp_path, child, readiness, control_plane)
    await agent.start()
    try:
        await agent.accept_start(start(3, "crash"))
        await control_plane.next_state(3, "starting")
        failed = await control_plane.next_state(3, "failed")
        assert "failed with exit code 3" in failed.reason and "boom: the engine fell over" in failed.reason
        assert (failed.attempt, failed.permanent) == (0, False)  # a crash may not happen again
        assert agent.supervisor.instances() == []  # the control plane decides whether it runs again

        # Exit code 2 is a usage error: the same start fails the same way, so the report says so.
        await agent.accept_start(start(5, "config", attempt=4))
        await control_plane.next_state(5, "starting")
        failed = await control_plane.next_state(5, "failed")
        assert (failed.attempt, failed.permanent) == (4, True)

        # A start whose model is missing fails before any process is launched, saying so; not for good: the
        # file system it is on may not be mounted yet.
        missing = msgspec.structs.replace(start(4), source=LocalSource(path=str(tmp_path / "nowhere.gguf")))
        await agent.accept_start(missing)
        failed = await control_plane.next_state(4, "failed")
        assert "does not exist on this node" in failed.reason and not failed.permanent
        assert not (tmp_path / "logs" / "instance-4.log").exists()

        # A path that is there and is not a model only a changed source fixes.
        (tmp_path / "notes.txt").write_text("not a model")
        invalid = msgspec.structs.replace(start(6), source=LocalSource(path=str(tmp_path / "notes.txt")))
        await agent.accept_start(invalid)
        failed = await control_plane.next_state(6, "failed")
        assert failed.permanent, failed.reason
    finally:
        await agent.close()


async def test_a_restarted_agent_adopts_its_workers_and_reconciles_them_with_the_control_plane(
    tmp_path: Path, child: Path, readiness: SocketReadiness
) -> None:
    before = StandInControlPlane()
    old = make_agent(tmp_path, child, readiness, before)
    await old.start()
    await old.accept_start(start(5, attempt=3))
    await old.accept_start(start(6))
    await old.accept_start(start(10))
    ready = {}
    while len(ready) < 3:
        instance_id, report = await before.next()
        if report.state == "ready":
            ready[instance_id] = report
    await old.close()  # the workers keep running
    os.kill(ready[10].pid or 0, signal.SIGKILL)  # one of them dies while no agent watches
    await pid_gone(ready[10].pid or 0)

    after = StandInControlPlane()
    after.instances = [
        AgentInstance(id=5, state="ready", model=AgentModel(id=1)),
        AgentInstance(id=6, state="stopping"),  # stopped by a person while no agent ran
        AgentInstance(id=10, state="ready"),
        AgentInstance(id=7, state="ready"),  # the control plane thinks it runs here; it does not
        AgentInstance(id=8, state="pending"),  # its start is still on its way
    ]
    new = make_agent(tmp_path, child, readiness, after)
    await new.start()
    try:
        # Adopted 6 may be reported ready before the reconciliation stops it: wait for each one's outcome.
        outcomes = {5: "ready", 6: "stopped", 7: "failed", 10: "failed"}
        reports: dict[int, InstanceReport] = {}
        about_10 = []
        while any(reports.get(i) is None or reports[i].state != state for i, state in outcomes.items()):
            instance_id, report = await after.next()
            assert instance_id in outcomes, report
            reports[instance_id] = report
            if instance_id == 10:
                about_10.append(report)
        assert (reports[5].state, reports[5].pid) == ("ready", ready[5].pid)  # adopted, still serving
        assert reports[6].state == "stopped"
        assert ready[6].pid is not None and process_start_time(ready[6].pid) is None
        assert reports[7].state == "failed" and "no worker of this instance runs on node node-a" in reports[7].reason
        # 10 is reported once, by the adoption, which says how it ended (the reconciliation, done by the time
        # 7 is reported, adds nothing).
        [died] = about_10
        assert "ended while the agent was not watching it" in died.reason, died

        # The adopted worker's attempt was kept: a repeat of its start launches nothing.
        await new.accept_start(start(5, attempt=3))
        assert await after.next() == (5, reports[5])
        assert launches(tmp_path, 5) == 1
    finally:
        await new.supervisor.stop_all()
        await new.close()


async def test_a_start_on_gpus_whose_uuids_are_not_the_reserved_ones_is_refused_and_nothing_runs(
    tmp_path: Path, child: Path, readiness: SocketReadiness
) -> None:
    control_plane = StandInControlPlane()
    agent = make_agent(tmp_path, child, readiness, control_plane)
    await agent.start()
    try:
        here = [gpu.uuid for gpu in (await agent.node_report()).gpus]
        await agent.accept_start(start(6, gpu_indexes=[1], gpu_uuids=["GPU-8f1c0000-swapped-away"]))
        failed = await control_plane.next_state(6, "failed")
        assert f"GPU 1 is {here[1]} on this node, but the control plane reserved GPU-8f1c0000" in failed.reason
        assert not failed.permanent  # the next heartbeat tells the control plane, which places it again
        await agent.accept_start(start(7, gpu_indexes=[5]))
        failed = await control_plane.next_state(7, "failed")
        assert "GPU 5 is not on this node (it has 2)" in failed.reason
        assert agent.supervisor.instances() == []
        assert not (tmp_path / "logs" / "instance-6.log").exists()

        # The GPUs it was placed on, named as the node's heartbeat named them: it runs (simulated GPUs are
        # named to CUDA by index, since their UUIDs mean nothing to it).
        await agent.accept_start(start(8, gpu_indexes=[1], gpu_uuids=[here[1]]))
        await control_plane.next_state(8, "starting")
        await control_plane.next_state(8, "ready")
        assert "CUDA_VISIBLE_DEVICES=1\n" in (tmp_path / "logs" / "instance-8.log").read_text()
    finally:
        await agent.supervisor.stop_all()
        await agent.close()
