"""The node agent's starts whose model is downloading: a stop ends the download at once, and an agent that
restarts carries on the downloads its predecessor left, where the control plane still wants them.

The agent runs in this process with a stand-in control plane (tests/agent/test_node_agent_operations.py's),
tiny Python children as its workers, and a fake hub on loopback (tests/agent/fake_hub.py) whose transfer of
the model is held once its first chunk is sent (huggingface_hub writes files 10 MiB at a time).
"""

import asyncio
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from huggingface_hub.constants import DOWNLOAD_CHUNK_SIZE

from agent.control_plane_client import AgentInstance, AgentModel
from agent.downloads import HubSettings, ModelDownloader
from agent.inventory import Inventory
from agent.node_agent import NodeAgent
from runtime.fleet_contract.tasks import HubSource, StartInstance, StopInstance
from tests.agent.fake_hub import FakeHub, running_hub
from tests.agent.test_download_stop_and_resume import download_processes, downloading_threads
from tests.agent.test_node_agent_operations import GIB, StandInControlPlane, child, readiness, start
from tests.agent.test_supervisor import SocketReadiness

__all__ = ["child", "readiness"]  # fixtures

pytestmark = pytest.mark.timeout(120)

REPO = "acme/big-gguf"
FILE = "model.gguf"
SIZE = 2 * DOWNLOAD_CHUNK_SIZE + 4321


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with running_hub() as hub:
        hub.repos[REPO] = {FILE: os.urandom(SIZE)}
        yield hub


def make_agent(
    tmp_path: Path, child: Path, readiness: SocketReadiness, control_plane: StandInControlPlane, hub: FakeHub
) -> tuple[NodeAgent, ModelDownloader]:
    downloader = ModelDownloader(
        tmp_path / "models", hub=HubSettings(endpoint=hub.url, timeout_s=10), progress_interval_s=0.05
    )
    agent = NodeAgent(
        node="node-a",
        client=control_plane,
        downloader=downloader,
        inventory=Inventory([24 * GIB]),
        readiness=readiness,
        state_dir=tmp_path / "state",
        log_dir=tmp_path / "logs",
        heartbeat_s=3600,
        worker_command=[sys.executable, str(child)],
        worker_env={**os.environ, "READY_SOCKET": str(readiness.path)},
        stop_timeout_s=10,
        reconcile_s=3600,
    )
    return agent, downloader


def hub_start(instance_id: int, attempt: int = 0, incarnation: str = "") -> StartInstance:
    request = start(instance_id, attempt=attempt)
    return msgspec.structs.replace(request, source=HubSource(REPO), incarnation=incarnation)


async def downloading_past_the_first_chunk(control_plane: StandInControlPlane, instance_id: int) -> None:
    """Wait for the instance's reports until one says the first chunk is on disk."""
    while True:
        report = await control_plane.next_state(instance_id, "downloading")
        if (report.download_progress or 0) >= DOWNLOAD_CHUNK_SIZE / SIZE:
            return


async def test_a_stop_during_a_download_ends_it_at_once_and_it_is_not_resumed(
    tmp_path: Path, child: Path, readiness: SocketReadiness, hub: FakeHub
) -> None:
    hold = hub.hold(FILE, DOWNLOAD_CHUNK_SIZE)
    control_plane = StandInControlPlane()
    agent, downloader = make_agent(tmp_path, child, readiness, control_plane, hub)
    await agent.start()
    try:
        await agent.accept_start(hub_start(1))
        await downloading_past_the_first_chunk(control_plane, 1)
        await agent.accept_stop(StopInstance(instance_id=1, attempt=0))
        await control_plane.next_state(1, "stopped")
        # The hub's transfer, still held, sees the connection closed: no byte is sent after the stop.
        assert await _waited(hold.hung_up)
        assert hub.bytes_served(FILE) == DOWNLOAD_CHUNK_SIZE
        assert not (tmp_path / "state" / "start-1.json").exists()  # a next agent has nothing to resume
        assert download_processes() == []
        assert downloading_threads() == []
    finally:
        await agent.close()
        await downloader.close()


async def test_a_restarted_agent_resumes_the_downloads_the_control_plane_still_wants_from_their_partial_files(
    tmp_path: Path, child: Path, readiness: SocketReadiness, hub: FakeHub
) -> None:
    hold = hub.hold(FILE, DOWNLOAD_CHUNK_SIZE)
    before = StandInControlPlane()
    old, old_downloader = make_agent(tmp_path, child, readiness, before, hub)
    await old.start()
    await old.accept_start(hub_start(1, attempt=2, incarnation="inc-1"))
    await downloading_past_the_first_chunk(before, 1)
    # Starts of the same model that the control plane will have changed its mind about meanwhile.
    for instance_id in (2, 3, 4):
        await old.accept_start(hub_start(instance_id))
    await old.close()  # in the middle of the download: its process is killed, its partial file stays
    await old_downloader.close()
    assert await _waited(hold.hung_up)
    kept = sorted(path.name for path in (tmp_path / "state").glob("start-*.json"))
    assert kept == ["start-1.json", "start-2.json", "start-3.json", "start-4.json"]

    after = StandInControlPlane()
    after.instances = [
        AgentInstance(id=1, state="downloading", attempt=2, incarnation="inc-1", model=AgentModel(id=7)),
        AgentInstance(id=2, state="pending", attempt=1),  # restarted meanwhile: a newer start is on its way
        AgentInstance(id=3, state="stopping", attempt=0),  # stopped by a person meanwhile
    ]  # and 4 was moved to another node
    new, new_downloader = make_agent(tmp_path, child, readiness, after, hub)
    await new.start()
    try:
        reports = []
        while not reports or reports[-1] != (1, "ready"):
            instance_id, report = await after.next()
            reports.append((instance_id, report.state))
            if instance_id == 1:
                assert (report.attempt, report.incarnation) == (2, "inc-1"), report
        # Instance 1 carried on, never reported failed; 3 reported stopped (nothing ran); 2 and 4 left alone.
        assert {state for instance_id, state in reports if instance_id == 1} == {"downloading", "starting", "ready"}
        assert (3, "stopped") in reports
        assert not [report for report in reports if report[0] in (2, 4)]
        # The download resumed from the partial file: no byte of the model was sent twice.
        assert [(get.start, get.sent) for get in hub.gets(FILE)] == [
            (0, DOWNLOAD_CHUNK_SIZE),
            (DOWNLOAD_CHUNK_SIZE, SIZE - DOWNLOAD_CHUNK_SIZE),
        ]
        done = [report for model_id, report in after.downloads if model_id == 7]
        assert done[-1].state == "done" and done[-1].bytes_done == SIZE
        assert sorted(path.name for path in (tmp_path / "state").glob("start-*.json")) == []
    finally:
        await new.supervisor.stop_all()
        await new.close()
        await new_downloader.close()


async def _waited(event: threading.Event) -> bool:
    return await asyncio.to_thread(event.wait, 30)


async def test_a_projector_of_the_models_repo_is_fetched_after_it_and_given_to_the_worker(
    tmp_path: Path, child: Path, readiness: SocketReadiness, hub: FakeHub
) -> None:
    projector = os.urandom(5000)
    hub.repos[REPO]["mmproj-f16.gguf"] = projector
    control_plane = knowing_model_7()
    agent, downloader = make_agent(tmp_path, child, readiness, control_plane, hub)
    await agent.start()
    try:
        await agent.accept_start(with_projector("mmproj-f16.gguf"))
        states = []
        while not states or states[-1] != "ready":
            instance_id, report = await control_plane.next()
            assert instance_id == 1 and report.state != "failed", report
            states.append(report.state)
        assert "downloading" in states
        argv = (tmp_path / "logs" / "instance-1.log").read_text().split("argv: ", 1)[1].split()
        given = argv[argv.index("--mmproj") + 1]
        assert given.endswith("/mmproj-f16.gguf") and _contents(given) == projector
        assert _contents(argv[argv.index("out=llamacpp") + 1]) == hub.repos[REPO][FILE]
        # The model's download figures are its own file's; its "done" comes once the projector is there too, with
        # the projector's size on disk beside them (the catalog's memory estimate counts it).
        done = [report for model_id, report in control_plane.downloads if model_id == 7 and report.state == "done"]
        assert [(report.bytes_done, report.projector_bytes) for report in done] == [(SIZE, len(projector))]
    finally:
        await agent.supervisor.stop_all()
        await agent.close()
        await downloader.close()


def _contents(path: str) -> bytes:
    return Path(path).read_bytes()


def knowing_model_7() -> StandInControlPlane:
    """A control plane whose instance 1 is of model 7, so that downloads are reported per model too."""
    control_plane = StandInControlPlane()
    control_plane.instances = [AgentInstance(id=1, state="pending", attempt=0, model=AgentModel(id=7))]
    return control_plane


def with_projector(projector_file: str) -> StartInstance:
    """Instance 1's start of the repo's GGUF on llama.cpp, with ``projector_file`` of the same repo."""
    return msgspec.structs.replace(
        start(1, engine="llamacpp"), source=HubSource(REPO, file=FILE), projector=HubSource(REPO, file=projector_file)
    )


async def test_a_projector_the_repo_lacks_fails_the_start_saying_so_and_starts_no_worker(
    tmp_path: Path, child: Path, readiness: SocketReadiness, hub: FakeHub
) -> None:
    control_plane = knowing_model_7()
    agent, downloader = make_agent(tmp_path, child, readiness, control_plane, hub)
    await agent.start()
    try:
        await agent.accept_start(with_projector("mmproj-missing.gguf"))
        while (report := (await control_plane.next())[1]).state == "downloading":
            pass
        assert report.state == "failed", report
        assert report.reason.startswith("the projector: ") and "mmproj-missing.gguf" in report.reason, report
        assert not agent.supervisor.status(1)  # no worker was started without it
        # The model's files on this node are not all there: its download failed, saying which one.
        ends = [report for model_id, report in control_plane.downloads if report.state in ("done", "failed")]
        assert [report.state for report in ends] == ["failed"]
        assert ends[0].error.startswith("the projector: ")
    finally:
        await agent.supervisor.stop_all()
        await agent.close()
        await downloader.close()
