"""The agent's Celery consumer on a real Redis: tasks sent as the control plane sends them reach the agent's
loop decoded, log tails come back through the result backend, malformed tasks fail with their reason and
leave the consumer running, starts the node may not run are refused (and the agent told, to report it),
only the node's own queue is consumed, and a broker that is down at first is waited for."""

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import pytest
import redis
from celery import Celery
from celery.result import AsyncResult, allow_join_result

from agent.errors import WorkerError
from agent.task_consumer import TaskConsumer
from runtime.fleet_tasks import (
    TASK_LOG_TAIL,
    TASK_START_INSTANCE,
    TASK_STOP_INSTANCE,
    LocalSource,
    LogTailRequest,
    StartInstance,
    StopInstance,
    WorkerSpec,
    node_queue,
)
from tests.infra import RedisServer

pytestmark = pytest.mark.timeout(60)

START = StartInstance(
    spec=WorkerSpec(instance_id=7, pipeline="chat", group="aggregated", replica=0, engine="mocker", gpu_indexes=[1]),
    source=LocalSource(path="/models/smol.gguf"),
    attempt=2,
)


class Refused(NamedTuple):
    instance_id: int
    reason: str
    attempt: int | None


class RecordingHandler:
    """The agent's side, recording what it was handed (on the test's loop)."""

    def __init__(self) -> None:
        self.received: asyncio.Queue[object] = asyncio.Queue()
        self.loop_thread_ids: set[int] = set()

    async def accept_start(self, request: StartInstance) -> None:
        self.received.put_nowait(request)

    async def accept_stop(self, request: StopInstance) -> None:
        self.received.put_nowait(request)

    async def refuse_start(self, instance_id: int, reason: str, attempt: int | None = None) -> None:
        self.received.put_nowait(Refused(instance_id, reason, attempt))

    async def log_tail(self, request: LogTailRequest) -> str:
        if request.instance_id == 404:
            raise WorkerError("instance 404 has no log on node node-a")
        return "\n".join(f"line {n} of instance {request.instance_id}" for n in range(request.lines))

    async def next(self) -> object:
        async with asyncio.timeout(20):
            return await self.received.get()


class Sender:
    """The control plane's side: a plain Celery app sending onto a node's queue."""

    def __init__(self, broker_url: str) -> None:
        self.app = Celery("control-plane-in-tests", broker=broker_url, backend=broker_url)

    def send(self, task: str, argument: object, *, node: str = "node-a", extra: tuple[object, ...] = ()) -> AsyncResult:
        payload = msgspec.to_builtins(argument) if isinstance(argument, msgspec.Struct) else argument
        return self.app.send_task(task, args=[payload, *extra], queue=node_queue(node))

    async def answer(self, result: AsyncResult) -> Any:
        def get() -> Any:
            # The consumer runs in this process, and Celery then forbids waiting for a result unless told.
            with allow_join_result():
                return result.get(timeout=20)

        return await asyncio.to_thread(get)


@pytest.fixture
def handler() -> RecordingHandler:
    return RecordingHandler()


@pytest.fixture
async def start_consumer(handler: RecordingHandler) -> AsyncIterator[Callable[[str], TaskConsumer]]:
    consumers: list[TaskConsumer] = []

    def start(broker_url: str) -> TaskConsumer:
        consumer = TaskConsumer(broker_url=broker_url, node="node-a", handler=handler, loop=asyncio.get_running_loop())
        consumer.start()
        consumers.append(consumer)
        return consumer

    yield start
    for consumer in consumers:
        await asyncio.to_thread(consumer.stop)


async def test_tasks_reach_the_agent_decoded_and_log_tails_come_back(
    redis_server: RedisServer, handler: RecordingHandler, start_consumer: Callable[[str], TaskConsumer]
) -> None:
    consumer = start_consumer(redis_server.url)
    assert await asyncio.to_thread(consumer.wait_ready, 20)
    sender = Sender(redis_server.url)

    sender.send(TASK_START_INSTANCE, START)
    assert await handler.next() == START
    stop = StopInstance(instance_id=7, reason="scaled down", grace_s=5)
    sender.send(TASK_STOP_INSTANCE, stop)
    assert await handler.next() == stop
    tail = await sender.answer(sender.send(TASK_LOG_TAIL, LogTailRequest(instance_id=7, lines=2)))
    assert tail == "line 0 of instance 7\nline 1 of instance 7"

    with pytest.raises(Exception, match="instance 404 has no log on node node-a"):
        await sender.answer(sender.send(TASK_LOG_TAIL, LogTailRequest(instance_id=404)))


async def test_malformed_tasks_fail_with_their_reason_and_the_consumer_goes_on(
    redis_server: RedisServer,
    handler: RecordingHandler,
    start_consumer: Callable[[str], TaskConsumer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    consumer = start_consumer(redis_server.url)
    assert await asyncio.to_thread(consumer.wait_ready, 20)
    sender = Sender(redis_server.url)

    with pytest.raises(Exception, match=r"malformed LogTailRequest task argument: .*\$\.instance_id"):
        await sender.answer(sender.send(TASK_LOG_TAIL, {"instance_id": "seven"}))
    with pytest.raises(Exception, match="it takes one argument, got 2"):
        await sender.answer(sender.send(TASK_LOG_TAIL, {"instance_id": 7}, extra=(100,)))
    sender.send(TASK_START_INSTANCE, {"spec": {"instance_id": 7}})
    sender.send(TASK_STOP_INSTANCE, "stop everything")

    sender.send(TASK_START_INSTANCE, START)
    # The malformed start names its instance: the agent is told, to report it refused. Nothing else
    # reached the agent but the well-formed start.
    refused = await handler.next()
    assert isinstance(refused, Refused) and refused.instance_id == 7
    assert refused.reason.startswith("malformed StartInstance task argument")
    assert await handler.next() == START
    warnings = [r.getMessage() for r in caplog.records if r.name == "agent.task_consumer" and r.levelname == "WARNING"]
    assert any("task flotilla.agent.start_instance refused: malformed StartInstance" in w for w in warnings)
    assert any("task flotilla.agent.stop_instance refused: malformed StopInstance" in w for w in warnings)
    # No task crashed Celery's machinery. (Celery's signals are process-wide: a control-plane worker that
    # an earlier test ran in this process left its Django fix-up connected, which an agent never has.)
    crashes = [
        (record.name, record.getMessage())
        for record in caplog.records
        if record.exc_info and record.name.startswith("celery") and "DjangoWorkerFixup" not in record.getMessage()
    ]
    assert crashes == []


async def test_only_the_nodes_own_queue_is_consumed(
    redis_server: RedisServer, handler: RecordingHandler, start_consumer: Callable[[str], TaskConsumer]
) -> None:
    consumer = start_consumer(redis_server.url)
    assert await asyncio.to_thread(consumer.wait_ready, 20)
    sender = Sender(redis_server.url)
    sender.send(TASK_STOP_INSTANCE, StopInstance(instance_id=1), node="node-b")
    sender.send(TASK_STOP_INSTANCE, StopInstance(instance_id=2))
    assert await handler.next() == StopInstance(instance_id=2)
    assert handler.received.empty()
    assert redis.Redis.from_url(redis_server.url).llen("node.node-b") == 1  # still waiting for node-b's agent


async def test_a_broker_that_is_down_at_first_is_named_and_waited_for(
    tmp_path: Path,
    handler: RecordingHandler,
    start_consumer: Callable[[str], TaskConsumer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    late = RedisServer(tmp_path / "late-redis")
    consumer = start_consumer(late.url)
    assert not await asyncio.to_thread(consumer.wait_ready, 0.5)
    late.start()
    try:
        assert await asyncio.to_thread(consumer.wait_ready, 30)
        Sender(late.url).send(TASK_START_INSTANCE, START)
        assert await handler.next() == START
    finally:
        await asyncio.to_thread(consumer.stop)
        late.stop()
    refusals = [r.getMessage() for r in caplog.records if "Cannot connect to" in r.getMessage()]
    assert refusals and f"127.0.0.1:{late.port}" in refusals[0]


async def test_a_start_the_node_may_not_run_is_refused_with_its_reason_and_never_reaches_the_agent(
    redis_server: RedisServer,
    handler: RecordingHandler,
    start_consumer: Callable[[str], TaskConsumer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    consumer = start_consumer(redis_server.url)
    assert await asyncio.to_thread(consumer.wait_ready, 20)
    sender = Sender(redis_server.url)
    forged = {
        "pystr": {"engine": "pystr:/tmp/evil.py"},
        "unknown": {"engine": "bash"},
        "a second out=": {"engine_args": ["out=pytok:/tmp/evil.py"]},
        "labels": {"engine_args": ["--labels", "node=node-b"]},
    }
    for number, fields in enumerate(forged.values(), start=20):
        spec = msgspec.structs.replace(START.spec, instance_id=number, **fields)
        sender.send(TASK_START_INSTANCE, msgspec.structs.replace(START, spec=spec, attempt=number))
    refusals = [await handler.next() for _ in forged]
    assert [(r.instance_id, r.attempt) for r in refusals] == [(20, 20), (21, 21), (22, 22), (23, 23)]
    assert all(isinstance(r, Refused) for r in refusals)
    assert "runs a Python file of the node's" in refusals[0].reason
    assert "'bash' is not one of the fleet's" in refusals[1].reason
    assert "'out=pytok:/tmp/evil.py' is not a flag" in refusals[2].reason
    assert "'--labels' is not one a task may set" in refusals[3].reason
    warnings = [r.getMessage() for r in caplog.records if r.name == "agent.task_consumer" and r.levelname == "WARNING"]
    assert len([w for w in warnings if w.startswith("task flotilla.agent.start_instance refused: ")]) == len(forged)

    sender.send(TASK_START_INSTANCE, START)
    assert await handler.next() == START  # the consumer goes on
