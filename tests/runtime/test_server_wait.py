"""Waiting for etcd and NATS at start-up: the operator hears which is missing, where, and what to do."""

import asyncio
import logging
from collections.abc import Iterator

import pytest

from runtime.cluster.server_wait import ServerWait
from runtime.distributed import DistributedRuntime
from runtime.errors import DiscoveryUnavailable, FlotillaError
from tests.servers import free_port


class Warnings(logging.Handler):
    """Collects the warnings of runtime.cluster.server_wait; ``arrived(n)`` is awaitable until n have come."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self._changed = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        # Logged from the event loop's own thread (the waiting coroutine), so the Event may be set here.
        self.messages.append(record.getMessage())
        self._changed.set()

    async def arrived(self, count: int) -> list[str]:
        while len(self.messages) < count:
            self._changed.clear()
            await self._changed.wait()
        return self.messages


@pytest.fixture
def warnings() -> Iterator[Warnings]:
    handler = Warnings()
    logger = logging.getLogger("runtime.cluster.server_wait")
    # Other tests configure logging (FLOTILLA_LOG=error, say): make sure warnings get through here.
    level, logger.level = logger.level, logging.WARNING
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def etcd_wait(**timing: float) -> ServerWait:
    return ServerWait("etcd", "http://127.0.0.1:1", variable="ETCD_ENDPOINTS", error=DiscoveryUnavailable, **timing)


async def test_a_missing_server_is_named_then_reminded_of_until_it_answers(warnings: Warnings) -> None:
    waiting = etcd_wait(warn_after=0.01, remind_every=0.01)
    answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    waiting.failed(ConnectionRefusedError("Connection refused"))
    task = asyncio.create_task(waiting.wait(answer))

    first, reminder = await asyncio.wait_for(warnings.arrived(2), 10)
    for message in (first, reminder):
        assert "cannot reach etcd at http://127.0.0.1:1 (Connection refused)" in message
        assert "start one with `make services` or set ETCD_ENDPOINTS" in message
    answer.set_result("client")

    assert await task == "client"
    assert "connected to etcd at http://127.0.0.1:1 after" in warnings.messages[-1]


async def test_a_server_that_answers_at_once_is_not_warned_about(
    warnings: Warnings, caplog: pytest.LogCaptureFixture
) -> None:
    async def connect() -> str:
        return "client"

    with caplog.at_level(logging.INFO, logger="runtime.cluster.server_wait"):
        assert await etcd_wait().wait(connect()) == "client"
    assert warnings.messages == []
    assert "connected to etcd at http://127.0.0.1:1" in caplog.text


async def test_the_wait_gives_up_after_its_limit_saying_what_to_do() -> None:
    never: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    with pytest.raises(DiscoveryUnavailable, match=r"cannot reach etcd at http://127.0.0.1:1 .*make services"):
        await etcd_wait().wait(never, limit=0.05)
    assert never.cancelled()


async def test_cancelling_the_wait_stops_the_attempts() -> None:
    attempts: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(etcd_wait().wait(attempts))
    await asyncio.sleep(0)  # let the wait begin
    task.cancel()
    await asyncio.wait([task])
    assert task.cancelled()
    assert attempts.cancelled()


async def test_the_runtime_reports_both_servers_missing_not_only_the_first(warnings: Warnings) -> None:
    nats_url, etcd_endpoint = f"nats://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    with pytest.raises(FlotillaError, match=r"cannot reach (NATS|etcd)"):
        await DistributedRuntime.connect(nats_url=nats_url, etcd_endpoints=[etcd_endpoint], wait=1.5)
    text = "\n".join(warnings.messages)
    assert f"cannot reach NATS at {nats_url}" in text
    assert "set NATS_SERVER" in text
    assert f"cannot reach etcd at {etcd_endpoint}" in text
    assert "set ETCD_ENDPOINTS" in text
