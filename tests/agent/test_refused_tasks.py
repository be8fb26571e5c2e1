"""Forged tasks on the broker (real Redis, the agent's real consumer and main loop). One not signed for the
node is refused, logged at warning, and reported to nobody (nothing it says can be believed). One the
control plane signed that the node still may not run is refused before anything is fetched or launched,
logged, and reported as the instance failing for good with "refused by the agent: …"."""

import asyncio
import logging
import sys
from collections.abc import Mapping
from pathlib import Path

import msgspec
import pytest
from celery import Celery

from agent.control_plane_client import InstanceReport
from agent.downloads import ModelDownloader
from agent.inventory import Inventory
from agent.node_agent import NodeAgent
from agent.tasks.consumer import TaskConsumer
from runtime.fleet_contract.signing import agent_signing_key, sign_payload
from runtime.fleet_contract.tasks import TASK_START_INSTANCE, LocalSource, StartInstance, WorkerSpec, node_queue
from tests.infra import RedisServer

pytestmark = pytest.mark.timeout(60)

# Stands in for `flotilla run`: a worker that ran leaves a mark.
WORKER = "import pathlib, sys; pathlib.Path(sys.argv[1]).write_text('launched')"


class Reports:
    """The control plane's side: the instance reports it was sent."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[int, InstanceReport]] = asyncio.Queue()

    def report_instance(self, instance_id: int, report: InstanceReport) -> None:
        self.queue.put_nowait((instance_id, report))

    async def flush(self, timeout_s: float) -> bool:
        return True

    async def next(self) -> tuple[int, InstanceReport]:
        async with asyncio.timeout(20):
            return await self.queue.get()


class NeverReady:
    async def wait_registered(self, pid: int, labels: Mapping[str, str]) -> int:
        await asyncio.Event().wait()
        return 0


async def test_forged_starts_are_refused_and_logged_the_signed_ones_reported_failed_for_good_and_nothing_runs(
    tmp_path: Path, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    reports = Reports()
    mark = tmp_path / "launched"
    agent = NodeAgent(
        node="node-a",
        client=reports,  # type: ignore[arg-type]  # only reports are sent about a refused start
        downloader=ModelDownloader(tmp_path / "models"),
        inventory=Inventory([1 << 30]),
        readiness=NeverReady(),
        state_dir=tmp_path / "state",
        log_dir=tmp_path / "logs",
        worker_command=[sys.executable, "-c", WORKER, str(mark)],
    )
    key = agent_signing_key("flt_node-a-token", "node-a")
    consumer = TaskConsumer(
        broker_url=redis_server.url,
        node="node-a",
        handler=agent,
        loop=asyncio.get_running_loop(),
        signing_key=key,
        engines={"mocker"},
    )
    consumer.start()
    try:
        assert await asyncio.to_thread(consumer.wait_ready, 20)
        broker = Celery("forger", broker=redis_server.url)
        spec = WorkerSpec(instance_id=5, pipeline="p", group="aggregated", replica=0, engine="pystr:/tmp/evil.py")
        forged = StartInstance(spec=spec, source=LocalSource(path=str(tmp_path)), attempt=3, node="node-a")
        payload = msgspec.to_builtins(forged)

        def send(payload: dict[str, object]) -> None:
            broker.send_task(TASK_START_INSTANCE, args=[payload], queue=node_queue("node-a"))

        send({**payload, "spec": {**payload["spec"], "instance_id": 4}})  # not signed: not even reported
        send(sign_payload(TASK_START_INSTANCE, payload, [key]))
        # A spec with a field the agent does not know (a free environment) is refused too, not half-read.
        smuggled = {**payload, "spec": {**payload["spec"], "engine": "mocker", "instance_id": 6}}
        smuggled["spec"]["env"] = {"LD_PRELOAD": "/tmp/evil.so"}
        send(sign_payload(TASK_START_INSTANCE, smuggled, [key]))

        instance_id, report = await reports.next()
        assert (instance_id, report.state, report.permanent, report.attempt) == (5, "failed", True, 3)
        assert report.reason.startswith("refused by the agent: engine 'pystr:/tmp/evil.py' runs a Python file")
        instance_id, report = await reports.next()
        assert (instance_id, report.state, report.permanent) == (6, "failed", True)
        assert report.reason.startswith("refused by the agent: malformed StartInstance")
        assert "unknown field `env`" in report.reason
    finally:
        await asyncio.to_thread(consumer.stop)
        await agent.close(flush_s=0)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name.startswith("agent.")]
    assert sum("refused" in w for w in warnings) == 3, warnings
    assert "task flotilla.agent.start_instance refused: the task did not come from the control plane" in warnings[0]
    assert not mark.exists() and reports.queue.empty()  # nothing fetched, launched or reported beyond that
