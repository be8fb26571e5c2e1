"""Owned background tasks: a failure is logged and restarted, or it stops the runtime; none dies unseen."""

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client as NATS

from runtime.cluster.addressing import EndpointAddress
from runtime.cluster.nats_connection import connect_nats
from runtime.distributed import DistributedRuntime, worker
from runtime.engine import RequestContext
from runtime.errors import BackgroundTaskFailed
from runtime.request_plane import EndpointServer, RequestClient
from runtime.supervision import Supervisor
from tests.infra import EtcdServer, NatsServer


class Broken(Exception):
    pass


async def fail() -> None:
    await asyncio.sleep(0)
    raise Broken("the watch fell over")


async def test_a_failed_task_is_logged_with_its_traceback_and_shuts_the_owner_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    shut_down = asyncio.Event()
    supervisor = Supervisor(on_fatal=shut_down.set)
    supervisor.own(fail, name="model watcher", restart=False)
    await shut_down.wait()
    assert supervisor.failure == "background task 'model watcher' failed: Broken: the watch fell over"
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "'model watcher' failed" in record.getMessage()
    assert record.exc_info is not None and record.exc_info[0] is Broken
    await supervisor.close()


async def test_a_failed_restartable_task_is_logged_and_started_again(caplog: pytest.LogCaptureFixture) -> None:
    runs = 0
    second_run = asyncio.Event()

    async def flaky() -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            raise Broken("first run")
        second_run.set()
        await asyncio.Event().wait()

    supervisor = Supervisor(on_fatal=lambda: pytest.fail("a restartable task must not be fatal"))
    supervisor.own(flaky, name="flaky", restart=True)
    await second_run.wait()
    assert supervisor.failure is None
    [record] = [r for r in caplog.records if "restarting" in r.getMessage()]
    assert record.exc_info is not None and record.exc_info[0] is Broken
    await supervisor.close()


async def test_closing_cancels_owned_tasks_and_records_no_failure() -> None:
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    supervisor = Supervisor(on_fatal=lambda: pytest.fail("a cancelled task is not a failure"))
    supervisor.own(forever, name="forever", restart=False)
    await started.wait()
    await supervisor.close()
    assert supervisor.failure is None


async def test_supervisors_cancelled_together_let_none_of_their_tasks_run() -> None:
    """An owner that stops several supervisors cancels them all first: the first one's wait for its
    tasks would otherwise let the others' tasks run (and fail, against a connection being closed)."""
    ran: list[str] = []

    async def note(name: str) -> None:
        ran.append(name)

    supervisors = [Supervisor(on_fatal=lambda: None) for _ in range(3)]
    for number, supervisor in enumerate(supervisors):
        supervisor.own(lambda number=number: note(f"task {number}"), name=f"task {number}", restart=False)
    for supervisor in supervisors:
        supervisor.cancel()
    for supervisor in supervisors:
        await supervisor.close()
    assert ran == []
    assert all(supervisor.running == 0 and supervisor.failure is None for supervisor in supervisors)


@pytest.fixture
async def runtime(etcd_server: EtcdServer, nats_server: NatsServer) -> AsyncIterator[DistributedRuntime]:
    connected = await DistributedRuntime.connect(nats_url=nats_server.url, etcd_endpoints=[etcd_server.endpoint])
    yield connected
    await connected.close()


async def test_a_failed_owned_task_shuts_the_runtime_down_with_its_failure(runtime: DistributedRuntime) -> None:
    runtime.own(asyncio.create_task(fail(), name="load metrics"))
    await runtime.wait_for_shutdown()
    assert runtime.failure is not None and "'load metrics' failed" in runtime.failure


async def test_a_running_task_cannot_be_owned_as_restartable(runtime: DistributedRuntime) -> None:
    task = asyncio.create_task(asyncio.sleep(0))
    with pytest.raises(ValueError, match="coroutine factory"):
        runtime.own(task, restart=True)
    await task


async def test_a_worker_whose_owned_task_failed_raises_once_closed(
    etcd_server: EtcdServer, nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NATS_SERVER", nats_server.url)
    monkeypatch.setenv("ETCD_ENDPOINTS", etcd_server.endpoint)
    monkeypatch.setenv("FLOTILLA_DRAIN_S", "0")

    @worker
    async def main(runtime: DistributedRuntime) -> None:
        runtime.own(fail, name="publisher")
        await asyncio.Event().wait()

    with pytest.raises(BackgroundTaskFailed, match="'publisher' failed: Broken"):
        await main()


async def count(payload: msgspec.Raw, context: RequestContext) -> AsyncIterator[bytes]:
    for number in range(msgspec.msgpack.decode(payload)):
        yield msgspec.msgpack.encode(number)


async def test_concurrent_first_calls_all_get_a_started_request_client(
    runtime: DistributedRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint = runtime.endpoint(EndpointAddress.parse("dyn://test.backend.generate"))
    await endpoint.serve_bytes(count)
    subscribe = runtime.nc.subscribe

    async def busy_subscribe(*args: Any, **kwargs: Any) -> Any:
        # On a busy connection SUB waits for the outgoing buffer: the client's start-up takes turns.
        await asyncio.sleep(0)
        return await subscribe(*args, **kwargs)

    monkeypatch.setattr(runtime.nc, "subscribe", busy_subscribe)

    async def first_request(index: int) -> list[object]:
        # On a cold runtime every caller races for the client; each must get one that can send.
        client = await runtime.client()
        frames = client.call(endpoint.subject, f"r{index}", msgspec.msgpack.encode(3))
        return [msgspec.msgpack.decode(payload) async for frame in frames for payload in frame]

    answers = await asyncio.gather(*(first_request(index) for index in range(16)))
    assert answers == [[0, 1, 2]] * 16


def dying_once(loop: Callable[[], Coroutine[Any, Any, None]], second_run: asyncio.Event) -> Callable[[], Any]:
    """``loop``, except that its first run dies of a bug."""
    runs = 0

    async def run() -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            await asyncio.sleep(0)
            raise Broken("the loop fell over")
        second_run.set()
        await loop()

    return run


@pytest.fixture
async def connections(nats_server: NatsServer) -> AsyncIterator[tuple[NATS, NATS]]:
    worker_nc = await connect_nats(nats_server.url, name="worker")
    client_nc = await connect_nats(nats_server.url, name="client")
    yield worker_nc, client_nc
    await worker_nc.close()
    await client_nc.close()


@pytest.mark.parametrize("loop", ["_heartbeat_loop", "_send_forever"])
async def test_a_request_plane_server_s_loop_that_dies_is_logged_and_restarted(
    connections: tuple[NATS, NATS], loop: str, caplog: pytest.LogCaptureFixture
) -> None:
    worker_nc, client_nc = connections
    server = EndpointServer(worker_nc, "flotilla.test.backend.generate.1", count, heartbeat_interval=0.05)
    second_run = asyncio.Event()
    setattr(server, loop, dying_once(getattr(server, loop), second_run))
    await server.start()
    async with asyncio.timeout(30):
        await second_run.wait()
    assert "failed; restarting it" in caplog.text and "the loop fell over" in caplog.text
    client = RequestClient(client_nc)
    await client.start()
    frames = client.call(server.subject, "r", msgspec.msgpack.encode(3))
    assert [msgspec.msgpack.decode(payload) async for frame in frames for payload in frame] == [0, 1, 2]
    await client.close()
    await server.close()


async def test_the_request_client_s_probe_loop_that_dies_is_logged_and_restarted(
    connections: tuple[NATS, NATS], caplog: pytest.LogCaptureFixture
) -> None:
    _, client_nc = connections
    client = RequestClient(client_nc)
    second_run = asyncio.Event()
    client._probe_forever = dying_once(client._probe_forever, second_run)  # type: ignore[method-assign]
    await client.start()
    async with asyncio.timeout(30):
        await second_run.wait()
    assert "'request client probes' failed; restarting it" in caplog.text
    await client.close()
