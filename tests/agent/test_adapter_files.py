"""The pipelines' LoRA adapters on a node: each pipeline's adapter file, written from a worker's start and from
SetAdapters tasks (the real consumer on a real Redis, signed as the control plane signs), with the adapters
fetched as models are (a fake hub on loopback, local folders checked), and the workers started with
``--lora-file``. A fetch that fails leaves that adapter out, is logged, and is tried again on the next copy."""

import asyncio
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from agent.adapter_files import AdapterFiles
from agent.control_plane_client import NodeReport
from agent.downloads import HubSettings, ModelDownloader
from agent.errors import TaskNotAllowed
from agent.heartbeats import Heartbeats
from agent.inventory import Inventory
from agent.node_agent import NodeAgent
from agent.tasks.checks import check_start
from agent.tasks.consumer import TaskConsumer
from agent.workers.spec import worker_argv
from runtime.fleet_contract.reports import AdapterFailure
from runtime.fleet_contract.tasks import (
    TASK_SET_ADAPTERS,
    AdapterSource,
    HubSource,
    LocalSource,
    SetAdapters,
    StartInstance,
    WorkerSpec,
)
from runtime.lora import AdapterSet, LoraAdapter
from tests.agent.fake_hub import SHA, FakeHub, running_hub
from tests.agent.test_node_agent_operations import StandInControlPlane, child, launches, readiness  # noqa: F401
from tests.agent.test_supervisor import SocketReadiness
from tests.agent.test_task_consumer import KEY, Sender
from tests.infra import RedisServer

pytestmark = pytest.mark.timeout(60)

GIB = 1 << 30


def adapter_folder(root: Path, name: str) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text('{"r": 8}')
    return folder


def local(name: str, path: Path) -> AdapterSource:
    return AdapterSource(name=name, source=LocalSource(path=str(path)))


def held(files: AdapterFiles, pipeline: str, pipeline_id: int = 0) -> AdapterSet:
    return msgspec.json.decode(files.path(pipeline, pipeline_id).read_bytes(), type=AdapterSet)


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with running_hub() as hub:
        yield hub


async def test_the_file_lists_each_fetched_adapter_by_its_local_path(tmp_path: Path, hub: FakeHub) -> None:
    hub.repos["acme/sql-lora"] = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": bytes(1000)}
    chat = adapter_folder(tmp_path / "adapters", "chat")
    files = AdapterFiles(ModelDownloader(tmp_path / "models", hub=HubSettings(endpoint=hub.url, timeout_s=10)))
    adapters = [
        AdapterSource(name="smol-sql", source=HubSource(repo_id="acme/sql-lora", revision="v1")),
        local("smol-chat", chat),
    ]

    path = await files.apply("chat", adapters, 3)

    assert path == tmp_path / "models" / "adapter-sets" / "chat.0.json"
    snapshot = tmp_path / "models" / "models--acme--sql-lora" / "snapshots" / SHA
    assert held(files, "chat") == AdapterSet(
        adapters=[LoraAdapter(name="smol-sql", path=str(snapshot)), LoraAdapter(name="smol-chat", path=str(chat))],
        generation=3,
    )
    assert sorted(entry.name for entry in snapshot.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


async def test_an_older_set_never_replaces_a_newer_one(tmp_path: Path) -> None:
    sql = adapter_folder(tmp_path / "adapters", "sql")
    files = AdapterFiles(ModelDownloader(tmp_path / "models"))
    await files.apply("chat", [local("sql", sql)], 2)
    await files.apply("chat", [], 1)  # a task delivered late
    assert held(files, "chat").adapters == [LoraAdapter(name="sql", path=str(sql))]
    await files.apply("chat", [], 3)
    assert held(files, "chat") == AdapterSet(adapters=[], generation=3)


async def test_a_pipeline_that_takes_a_deleted_one_s_namespace_has_a_file_of_its_own(tmp_path: Path) -> None:
    """Namespaces are freed when a pipeline is deleted (``chat`` again for a new ``chat``): the old pipeline's file,
    at a later generation, must neither be read by the new one's workers nor outrank the new one's sets."""
    sql = adapter_folder(tmp_path / "adapters", "sql")
    files = AdapterFiles(ModelDownloader(tmp_path / "models"))
    old = await files.apply("chat", [local("sql", sql)], 7, pipeline_id=1)
    new = await files.apply("chat", [], 0, pipeline_id=2)
    assert new != old
    assert held(files, "chat", 2) == AdapterSet(adapters=[], generation=0)
    await files.apply("chat", [local("sql", sql)], 1, pipeline_id=2)
    assert held(files, "chat", 2).adapters == [LoraAdapter(name="sql", path=str(sql))]


async def test_an_adapter_that_cannot_be_fetched_is_left_out_logged_and_tried_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="agent.adapter_files")
    sql = adapter_folder(tmp_path / "adapters", "sql")
    later = tmp_path / "adapters" / "later"
    not_an_adapter = tmp_path / "adapters" / "model"
    not_an_adapter.mkdir()
    (not_an_adapter / "config.json").write_text("{}")
    files = AdapterFiles(ModelDownloader(tmp_path / "models"))
    adapters = [local("sql", sql), local("later", later), local("model", not_an_adapter)]

    await files.apply("chat", adapters, 1)

    assert held(files, "chat").adapters == [LoraAdapter(name="sql", path=str(sql))]
    assert [record.getMessage() for record in caplog.records] == [
        f"pipeline chat: adapter later left out of its workers' set: adapter path {str(later)!r} does not exist "
        "on this node",
        f"pipeline chat: adapter model left out of its workers' set: folder {str(not_an_adapter)!r} has no "
        "adapter_config.json, so it is not a LoRA adapter",
    ]
    # What the heartbeat tells the control plane meanwhile:
    assert files.failures() == [
        AdapterFailure(
            pipeline_id=0, adapter="later", reason=f"adapter path {str(later)!r} does not exist on this node"
        ),
        AdapterFailure(
            pipeline_id=0,
            adapter="model",
            reason=f"folder {str(not_an_adapter)!r} has no adapter_config.json, so it is not a LoRA adapter",
        ),
    ]
    adapter_folder(tmp_path / "adapters", "later")  # mounted since
    await files.apply("chat", adapters, 1)  # the control plane's next copy of the same set
    assert [adapter.name for adapter in held(files, "chat").adapters] == ["sql", "later"]
    assert [failure.adapter for failure in files.failures()] == ["model"]
    await files.apply("chat", [local("sql", sql)], 2)  # "model" unloaded: nothing is left to report
    assert files.failures() == []


async def test_a_start_of_a_pipeline_that_has_adapters_runs_the_worker_with_its_file(
    tmp_path: Path,
    child: Path,  # noqa: F811
    readiness: SocketReadiness,  # noqa: F811
) -> None:
    sql = adapter_folder(tmp_path / "adapters", "sql")
    control_plane = StandInControlPlane()
    agent = make_agent(tmp_path, child, readiness, control_plane)
    await agent.start()
    try:
        spec = WorkerSpec(
            instance_id=1,
            pipeline="chat",
            group="aggregated",
            replica=0,
            engine="mocker",
            adapters=[local("sql", sql)],
            adapter_generation=2,
        )
        await agent.accept_start(StartInstance(spec=spec))
        await control_plane.next_state(1, "starting")
        await control_plane.next_state(1, "ready")
        assert launches(tmp_path, 1) == 1
        lora_file = tmp_path / "models" / "adapter-sets" / "chat.0.json"
        log = (tmp_path / "logs" / "instance-1.log").read_text()
        assert f"out=mocker --lora-file {lora_file} --labels" in log
        assert held(agent.adapters, "chat") == AdapterSet(
            adapters=[LoraAdapter(name="sql", path=str(sql))], generation=2
        )
    finally:
        await agent.supervisor.stop_all()
        await agent.close()


def test_a_worker_gets_lora_file_only_when_the_agent_set_it_and_a_task_may_not_set_it() -> None:
    spec = WorkerSpec(instance_id=1, pipeline="chat", group="aggregated", replica=0, engine="mocker")
    assert "--lora-file" not in worker_argv(spec, "node-a")
    with_file = msgspec.structs.replace(spec, lora_file="/models/adapter-sets/chat.json")
    argv = worker_argv(with_file, "node-a")
    assert argv[argv.index("--lora-file") + 1] == "/models/adapter-sets/chat.json"
    with pytest.raises(TaskNotAllowed, match="the task names an adapter file"):
        check_start(StartInstance(spec=with_file, node="node-a"), engines={"mocker"}, node="node-a")
    bad_name = msgspec.structs.replace(spec, adapters=[local("has space", Path("/a"))])
    with pytest.raises(TaskNotAllowed, match="adapter name 'has space' is not"):
        check_start(StartInstance(spec=bad_name, node="node-a"), engines={"mocker"}, node="node-a")


async def test_a_signed_set_adapters_task_rewrites_the_pipelines_file_and_a_forged_one_is_refused(
    redis_server: RedisServer,
    tmp_path: Path,
    child: Path,  # noqa: F811
    readiness: SocketReadiness,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    sql = adapter_folder(tmp_path / "adapters", "sql")
    agent = make_agent(tmp_path, child, readiness, StandInControlPlane())
    applied = asyncio.Event()
    apply = agent.adapters.apply

    async def apply_and_tell(
        pipeline: str, adapters: list[AdapterSource], generation: int, pipeline_id: int = 0
    ) -> Path:
        path = await apply(pipeline, adapters, generation, pipeline_id)
        applied.set()
        return path

    agent.adapters.apply = apply_and_tell  # type: ignore[method-assign]
    await agent.start()
    consumer = TaskConsumer(
        broker_url=redis_server.url, node="node-a", handler=agent, loop=asyncio.get_running_loop(), signing_key=KEY
    )
    consumer.start()
    try:
        assert await asyncio.to_thread(consumer.wait_ready, 20)
        sender = Sender(redis_server.url)
        forged = SetAdapters(pipeline="chat", adapters=[local("evil", tmp_path)], generation=9, node="node-a")
        sender.send(TASK_SET_ADAPTERS, forged, key=None)
        sender.send(TASK_SET_ADAPTERS, msgspec.structs.replace(forged, pipeline="../etc"))
        task = SetAdapters(pipeline="chat", pipeline_id=4, adapters=[local("sql", sql)], generation=1, node="node-a")
        sender.send(TASK_SET_ADAPTERS, task)

        async with asyncio.timeout(20):
            await applied.wait()  # the only task taken: the others were refused before reaching the agent
        assert held(agent.adapters, "chat", 4) == AdapterSet(
            adapters=[LoraAdapter(name="sql", path=str(sql))], generation=1
        )
        refusals = [
            r.getMessage() for r in caplog.records if r.name == "agent.tasks.consumer" and r.levelname == "WARNING"
        ]
        assert refusals == [
            "task flotilla.agent.set_adapters refused: the task did not come from the control plane: it is not signed",
            "task flotilla.agent.set_adapters refused: pipeline '../etc' is not a namespace (1-64 letters, digits, "
            "'-' or '_')",
        ]
    finally:
        await asyncio.to_thread(consumer.stop)
        await agent.supervisor.stop_all()
        await agent.close()


def make_agent(
    tmp_path: Path,
    child: Path,  # noqa: F811
    readiness: SocketReadiness,  # noqa: F811
    control_plane: StandInControlPlane,
) -> NodeAgent:
    return NodeAgent(
        node="node-a",
        client=control_plane,
        downloader=ModelDownloader(tmp_path / "models"),
        inventory=Inventory([24 * GIB]),
        readiness=readiness,
        state_dir=tmp_path / "state",
        log_dir=tmp_path / "logs",
        heartbeat_s=3600,
        worker_command=[sys.executable, str(child)],
        worker_env={**os.environ, "READY_SOCKET": str(readiness.path)},
        stop_timeout_s=10,
        engines={"mocker"},
    )


async def test_the_heartbeat_says_which_adapters_the_node_could_not_fetch(tmp_path: Path) -> None:
    files = AdapterFiles(ModelDownloader(tmp_path / "models"))
    missing = tmp_path / "adapters" / "gone"
    await files.apply("chat", [local("gone", missing)], 1, pipeline_id=3)
    heartbeats = Heartbeats(
        client=NotCalled(),
        inventory=Inventory([1 << 30]),
        gpu_memory_in_use=dict,
        node="node-a",
        address="",
        version="",
        machine_id="",
        engines=(),
        interval_s=3600,
        adapter_failures=files.failures,
    )
    report = await heartbeats.node_report()
    assert report.adapter_failures == [
        AdapterFailure(
            pipeline_id=3, adapter="gone", reason=f"adapter path {str(missing)!r} does not exist on this node"
        )
    ]
    await files.apply("chat", [], 2, pipeline_id=3)
    assert (await heartbeats.node_report()).adapter_failures == []  # said, so that the control plane forgets it


class NotCalled:
    async def register(self, report: NodeReport) -> None:
        raise AssertionError("not called")

    async def heartbeat(self, report: NodeReport) -> None:
        raise AssertionError("not called")


async def test_the_files_of_pipelines_no_worker_here_runs_are_deleted_once_old_and_their_failures_forgotten(
    tmp_path: Path,
) -> None:
    sql = adapter_folder(tmp_path / "adapters", "sql")
    files = AdapterFiles(ModelDownloader(tmp_path / "models"))
    running = await files.apply("chat", [local("sql", sql)], 1, pipeline_id=1)
    deleted = await files.apply("gone", [local("missing", tmp_path / "nowhere")], 1, pipeline_id=2)
    young = await files.apply("new", [], 1, pipeline_id=3)
    old = time.time() - 3600
    for path in (running, deleted):
        os.utime(path, (old, old))
    assert [failure.pipeline_id for failure in files.failures()] == [2]

    in_use = {AdapterFiles.key("chat", 1)}
    assert files.forget_unused(in_use, time.time(), min_age_s=600) == [deleted]
    assert running.exists() and young.exists() and not deleted.exists()
    assert files.failures() == []  # what was said of the deleted pipeline's adapters is not said again
    # Placed here again, it gets its file back with its start.
    assert await files.apply("gone", [local("sql", sql)], 2, pipeline_id=2) == deleted and deleted.exists()
