"""The agent's Celery consumer on a real Redis: tasks sent as the control plane sends them reach the agent's
loop decoded, log tails come back through the result backend, malformed tasks fail with their reason and
leave the consumer running, tasks not signed for the node or not naming it are refused and reach nobody,
starts the node may not run are refused (and the agent told, to report it), only the node's own queue is
consumed, and a broker that is down at first is waited for."""

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
from agent.tasks.consumer import TaskConsumer
from runtime.fleet_contract.signing import SigningKey, agent_signing_key, sign_payload
from runtime.fleet_contract.tasks import (
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

#: Node node-a's key: the control plane's signing key for it, and its agent's.
KEY = agent_signing_key("flt_the-agent-token-of-node-a", "node-a")
START = StartInstance(
    spec=WorkerSpec(instance_id=7, pipeline="chat", group="aggregated", replica=0, engine="mocker", gpu_indexes=[1]),
    source=LocalSource(path="/models/smol.gguf"),
    attempt=2,
    node="node-a",
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
        """What the agent was handed next (a task as it would act on it: its signatures left out)."""
        async with asyncio.timeout(20):
            received = await self.received.get()
        if isinstance(received, StartInstance | StopInstance):
            return msgspec.structs.replace(received, signatures={})
        return received


class Sender:
    """The control plane's side: a plain Celery app sending onto a node's queue."""

    def __init__(self, broker_url: str) -> None:
        self.app = Celery("control-plane-in-tests", broker=broker_url, backend=broker_url)

    def send(
        self,
        task: str,
        argument: object,
        *,
        node: str = "node-a",
        extra: tuple[object, ...] = (),
        key: SigningKey | None = KEY,
    ) -> AsyncResult:
        """Send ``argument`` (its JSON, signed with ``key`` when it is an object) onto ``node``'s queue."""
        payload = msgspec.to_builtins(argument) if isinstance(argument, msgspec.Struct) else argument
        if key is not None and isinstance(payload, dict):
            payload = sign_payload(task, payload, [key])
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
        consumer = TaskConsumer(
            broker_url=broker_url, node="node-a", handler=handler, loop=asyncio.get_running_loop(), signing_key=KEY
        )
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
    stop = StopInstance(instance_id=7, reason="scaled down", grace_s=5, node="node-a")
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
    sender.send(TASK_START_INSTANCE, {"spec": {"instance_id": 7}, "node": "node-a"})
    sender.send(TASK_START_INSTANCE, {"spec": {"instance_id": 8}})  # names no node: not reported
    sender.send(TASK_STOP_INSTANCE, {"instance_id": "all"})

    sender.send(TASK_START_INSTANCE, START)
    # The malformed start names its instance and this node: the agent is told, to report it refused.
    # Nothing else reached the agent but the well-formed start.
    refused = await handler.next()
    assert isinstance(refused, Refused) and refused.instance_id == 7
    assert refused.reason.startswith("malformed StartInstance task argument")
    assert await handler.next() == START
    warnings = [r.getMessage() for r in caplog.records if r.name == "agent.tasks.consumer" and r.levelname == "WARNING"]
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
    sender.send(TASK_STOP_INSTANCE, StopInstance(instance_id=1, node="node-b"), node="node-b")
    sender.send(TASK_STOP_INSTANCE, StopInstance(instance_id=2, node="node-a"))
    assert await handler.next() == StopInstance(instance_id=2, node="node-a")
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
    warnings = [r.getMessage() for r in caplog.records if r.name == "agent.tasks.consumer" and r.levelname == "WARNING"]
    assert len([w for w in warnings if w.startswith("task flotilla.agent.start_instance refused: ")]) == len(forged)

    sender.send(TASK_START_INSTANCE, START)
    assert await handler.next() == START  # the consumer goes on


async def test_tasks_not_signed_with_the_nodes_key_or_not_for_this_node_are_refused_and_reach_nobody(
    redis_server: RedisServer,
    handler: RecordingHandler,
    start_consumer: Callable[[str], TaskConsumer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    consumer = start_consumer(redis_server.url)
    assert await asyncio.to_thread(consumer.wait_ready, 20)
    sender = Sender(redis_server.url)
    other_nodes_key = agent_signing_key("flt_the-agent-token-of-node-b", "node-b")
    stolen_token_wrong_node = agent_signing_key("flt_the-agent-token-of-node-a", "node-b")

    sender.send(TASK_START_INSTANCE, START, key=None)  # a forged task: anyone with the broker's password
    sender.send(TASK_START_INSTANCE, START, key=other_nodes_key)  # node-b's agent, forging for node-a
    sender.send(TASK_START_INSTANCE, START, key=stolen_token_wrong_node)
    tampered = sign_payload(TASK_START_INSTANCE, msgspec.to_builtins(START), [KEY])
    tampered["spec"] = {**msgspec.to_builtins(START.spec), "engine": "llamacpp"}  # changed after signing
    sender.send(TASK_START_INSTANCE, tampered, key=None)
    # Signed by the control plane, but for another node (a queue mix-up, two machines with one name).
    sender.send(TASK_START_INSTANCE, msgspec.structs.replace(START, node="node-b"))
    sender.send(TASK_STOP_INSTANCE, StopInstance(instance_id=7))  # names no node
    with pytest.raises(Exception, match="it is not signed"):
        await sender.answer(sender.send(TASK_LOG_TAIL, LogTailRequest(instance_id=7), key=None))

    sender.send(TASK_STOP_INSTANCE, StopInstance(instance_id=9, node="node-a"))
    assert await handler.next() == StopInstance(instance_id=9, node="node-a")  # the only one taken
    assert handler.received.empty()  # and nothing reported about the others: nothing they say is believed
    warnings = [r.getMessage() for r in caplog.records if r.name == "agent.tasks.consumer" and r.levelname == "WARNING"]
    start = "task flotilla.agent.start_instance refused: "
    assert warnings[:7] == [
        start + "the task did not come from the control plane: it is not signed",
        start + "the task did not come from the control plane: it is not signed with node node-a's key "
        f"(key id {KEY.key_id}), or was changed since",
        start + "the task did not come from the control plane: it is not signed with node node-a's key "
        f"(key id {KEY.key_id}), or was changed since",
        start + "the task did not come from the control plane: it is not signed with node node-a's key "
        f"(key id {KEY.key_id}), or was changed since",
        start + "the task is for node 'node-b', not node-a",
        "task flotilla.agent.stop_instance refused: the task names no node",
        "task flotilla.agent.log_tail refused: the task did not come from the control plane: it is not signed",
    ]
