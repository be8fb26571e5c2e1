"""Signed tasks are acted on once, and only while valid on the control plane's clock: on a real Redis, an
expired task and a re-sent copy of one taken reach nobody (and are not reported), and a node whose clock is
half a minute ahead still takes fresh tasks. The agent reads the control plane's clock from the Date of its
answers (a real control plane's carry one: tests/agent/test_node_agent.py)."""

import asyncio
import email.utils
import time
from collections.abc import AsyncIterator

import httpx
import msgspec
import pytest

from agent.control_plane_client import ControlPlaneClient, NodeReport
from agent.control_plane_clock import ControlPlaneClock
from agent.tasks.consumer import TaskConsumer
from runtime.fleet_contract.tasks import TASK_START_INSTANCE, TASK_STOP_INSTANCE, StartInstance, StopInstance
from tests.agent.test_task_consumer import KEY, START, RecordingHandler, Sender
from tests.infra import RedisServer

pytestmark = pytest.mark.timeout(60)

#: How far this test's node clock is ahead of the control plane's.
SKEW_S = 30.0


def stamped(task: msgspec.Struct, *, issued_at: float, valid_for_s: float = 10.0, nonce: str = "") -> msgspec.Struct:
    return msgspec.structs.replace(
        task, issued_at=issued_at, valid_for_s=valid_for_s, nonce=nonce or f"{time.monotonic_ns():032x}"[-32:]
    )


def control_plane_now() -> float:
    """The control plane's clock, SKEW_S behind this node's (which the test process's time.time() plays)."""
    return time.time() - SKEW_S


@pytest.fixture
async def consumer(redis_server: RedisServer, handler: RecordingHandler) -> AsyncIterator[TaskConsumer]:
    started = TaskConsumer(
        broker_url=redis_server.url,
        node="node-a",
        handler=handler,
        loop=asyncio.get_running_loop(),
        signing_key=KEY,
        control_plane_now=control_plane_now,
    )
    started.start()
    assert await asyncio.to_thread(started.wait_ready, 20)
    yield started
    await asyncio.to_thread(started.stop)


@pytest.fixture
def handler() -> RecordingHandler:
    return RecordingHandler()


async def test_a_node_whose_clock_is_ahead_takes_fresh_tasks_and_refuses_expired_ones(
    redis_server: RedisServer, handler: RecordingHandler, consumer: TaskConsumer, caplog: pytest.LogCaptureFixture
) -> None:
    sender = Sender(redis_server.url)
    # Issued 30 s before now on this node's clock, which is now on the control plane's: fresh.
    fresh = stamped(START, issued_at=control_plane_now())
    # Issued 20 s ago on the control plane's clock, valid for 10: expired, whatever this node's clock says.
    expired = stamped(StopInstance(instance_id=8, node="node-a"), issued_at=control_plane_now() - 20)
    follower = stamped(StopInstance(instance_id=9, node="node-a"), issued_at=control_plane_now())

    sender.send(TASK_START_INSTANCE, fresh)
    sender.send(TASK_STOP_INSTANCE, expired)
    sender.send(TASK_STOP_INSTANCE, follower)

    taken = await handler.next()
    assert isinstance(taken, StartInstance) and taken.spec.instance_id == 7
    # The expired stop reached nobody (and nothing was reported): the next the agent was handed is the follower.
    after = await handler.next()
    assert isinstance(after, StopInstance) and after.instance_id == 9
    assert "task flotilla.agent.stop_instance expired: it was issued 20 s ago" in caplog.text


async def test_a_re_sent_copy_of_a_task_taken_reaches_nobody(
    redis_server: RedisServer, handler: RecordingHandler, consumer: TaskConsumer, caplog: pytest.LogCaptureFixture
) -> None:
    sender = Sender(redis_server.url)
    stop = stamped(StopInstance(instance_id=4, node="node-a", attempt=1), issued_at=control_plane_now())
    sender.send(TASK_STOP_INSTANCE, stop)
    sender.send(TASK_STOP_INSTANCE, stop)  # the same signed payload again, as anyone with the broker can
    sender.send(TASK_STOP_INSTANCE, stamped(StopInstance(instance_id=5, node="node-a"), issued_at=control_plane_now()))

    first, second = await handler.next(), await handler.next()
    assert isinstance(first, StopInstance) and first.instance_id == 4
    assert isinstance(second, StopInstance) and second.instance_id == 5
    assert f"was taken before (nonce {stop.nonce})" in caplog.text  # type: ignore[attr-defined]


def test_the_control_plane_clock_is_read_from_the_date_of_its_answers() -> None:
    clock = ControlPlaneClock()
    assert clock.offset_s is None and abs(clock.now() - time.time()) < 1  # no answer yet: this node's clock
    sent = time.time()
    ahead = email.utils.formatdate(sent + 90, usegmt=True)
    clock.observe(ahead, sent, sent + 0.2)
    assert clock.offset_s is not None and 89 <= clock.offset_s <= 91
    clock.observe("not a date", sent, sent)  # a malformed header changes nothing
    assert clock.offset_s is not None and 89 <= clock.offset_s <= 91


async def test_the_agent_client_keeps_the_skew_it_measures_on_each_answer() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        date = email.utils.formatdate(time.time() - SKEW_S, usegmt=True)  # a control plane 30 s behind
        body = {"name": "node-a", "state": "online", "draining": False}
        return httpx.Response(200, json=body, headers={"Date": date})

    transport = httpx.MockTransport(answer)
    async with ControlPlaneClient("http://cp:8000", "flt_t", node="node-a", transport=transport) as client:
        await client.heartbeat(NodeReport())
        assert client.clock.offset_s is not None and abs(client.clock.offset_s + SKEW_S) <= 1.5
