"""The request plane over a real NATS server: streams, stops, silence, refusals."""

import asyncio
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NATS

from runtime.engine import RequestContext
from runtime.nats_connection import connect_nats
from runtime.request_plane import (
    EndpointServer,
    RemoteError,
    RequestClient,
    StreamBroken,
    WorkerUnavailable,
)
from tests.infra import NatsServer

SUBJECT = "flotilla.test.backend.generate.1"


async def count(payload: bytes, context: RequestContext) -> AsyncIterator[bytes]:
    for number in range(int(payload)):
        if context.stopped:
            return
        await asyncio.sleep(0)
        yield str(number).encode()


@pytest.fixture
async def connections(nats_server: NatsServer) -> AsyncIterator[tuple[NATS, NATS]]:
    worker = await connect_nats(nats_server.url, name="worker")
    client = await connect_nats(nats_server.url, name="client")
    yield worker, client
    await worker.close()
    await client.close()


async def serve(nc: NATS, handler: object, **options: float) -> EndpointServer:
    server = EndpointServer(nc, SUBJECT, handler, **options)  # type: ignore[arg-type]
    await server.start()
    return server


async def test_a_stream_arrives_whole_and_in_order(connections: tuple[NATS, NATS]) -> None:
    worker, nc = connections
    server = await serve(worker, count)
    client = RequestClient(nc)
    await client.start()
    assert [item async for item in client.call(SUBJECT, "a", b"200")] == [str(n).encode() for n in range(200)]
    await server.close()


async def test_a_subject_nobody_serves_is_worker_unavailable(connections: tuple[NATS, NATS]) -> None:
    client = RequestClient(connections[1])
    await client.start()
    with pytest.raises(WorkerUnavailable, match="no instance listens"):
        await anext(client.call("flotilla.test.backend.generate.ff", "b", b"1"))


async def test_closing_the_stream_stops_the_handler(connections: tuple[NATS, NATS]) -> None:
    worker, nc = connections
    stopped = asyncio.Event()

    async def endless(payload: bytes, context: RequestContext) -> AsyncIterator[bytes]:
        try:
            while True:
                await asyncio.sleep(0.01)
                yield b"x"
        finally:
            stopped.set()

    server = await serve(worker, endless)
    client = RequestClient(nc)
    await client.start()
    stream = client.call(SUBJECT, "c", b"")
    await anext(stream)
    await stream.aclose()  # type: ignore[attr-defined]
    await asyncio.wait_for(stopped.wait(), 5)
    assert server.active_requests == 0
    await server.close()


async def test_a_handler_error_reaches_the_client(connections: tuple[NATS, NATS]) -> None:
    worker, nc = connections

    async def broken(payload: bytes, context: RequestContext) -> AsyncIterator[bytes]:
        yield b"first"
        raise ValueError("the engine broke")

    server = await serve(worker, broken)
    client = RequestClient(nc)
    await client.start()
    received: list[bytes] = []

    async def collect() -> None:
        async for item in client.call(SUBJECT, "d", b""):
            received.append(item)

    with pytest.raises(RemoteError, match="the engine broke"):
        await collect()
    assert received == [b"first"]
    await server.close()


async def test_heartbeats_keep_a_slow_stream_alive_and_silence_breaks_it(connections: tuple[NATS, NATS]) -> None:
    worker, nc = connections
    release = asyncio.Event()

    async def slow(payload: bytes, context: RequestContext) -> AsyncIterator[bytes]:
        await release.wait()
        yield b"late"

    server = await serve(worker, slow, heartbeat_interval=0.05)
    client = RequestClient(nc, silence_timeout=0.3)
    await client.start()
    stream = client.call(SUBJECT, "e", b"")
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.8)  # several silence periods pass with only heartbeats
    assert not first.done()
    release.set()
    assert await first == b"late"
    await stream.aclose()  # type: ignore[attr-defined]

    await server.close()
    # A worker that takes the request and then says nothing (no heartbeats): silence, then StreamBroken.
    release.clear()
    silent = EndpointServer(worker, SUBJECT, slow, heartbeat_interval=60)
    await silent.start()
    with pytest.raises(StreamBroken, match="went silent"):
        await anext(client.call(SUBJECT, "f", b""))
    await silent.close()


async def test_a_malformed_frame_fails_the_request_at_once(connections: tuple[NATS, NATS]) -> None:
    worker, nc = connections

    async def answer_garbage(msg: object) -> None:
        await worker.publish(msg.reply, b"\xc1 not a frame")  # type: ignore[attr-defined]

    await worker.subscribe(SUBJECT, cb=answer_garbage)
    await worker.flush()
    client = RequestClient(nc, silence_timeout=60)
    await client.start()
    with pytest.raises(RemoteError, match="malformed frame"):
        await asyncio.wait_for(anext(client.call(SUBJECT, "g", b"")), 5)
