"""Outputs that pile up behind a full window stay bounded, and no frame exceeds NATS's max_payload.

They used to pile up without limit and leave in one END frame: past the payload limit (about 70k
tokens at NATS's default 1 MiB) the frame was refused, the client heard nothing and migrated.
"""

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from runtime.cluster.nats_connection import connect_nats, flush
from runtime.engine import RequestContext
from runtime.request_plane import EndpointServer, RemoteError, RequestClient
from tests.infra import NatsServer

SUBJECT = "flotilla.test.backend.generate.1"
MAX_PAYLOAD = 4096
encode = msgspec.msgpack.encode


class SmallPayloadNats(NatsServer):
    """nats-server with a ``max_payload`` of 4 KiB, so that a few hundred outputs fill a frame."""

    def command(self) -> list[str]:
        config = self.directory / "nats.conf"
        config.write_text(f"max_payload: {MAX_PAYLOAD}\n")
        return [*super().command(), "-c", str(config)]


@pytest.fixture
def small_nats(tmp_path: Path) -> Iterator[NatsServer]:
    server = SmallPayloadNats(tmp_path / "nats", jetstream=False)
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def connections(small_nats: NatsServer) -> AsyncIterator[tuple[NATS, NATS]]:
    worker = await connect_nats(small_nats.url, name="worker")
    client = await connect_nats(small_nats.url, name="client")
    assert worker.max_payload == MAX_PAYLOAD
    yield worker, client
    await worker.close()
    await client.close()


class Outputs:
    """A handler that yields ``count`` outputs of about 100 bytes as fast as it is asked for them."""

    def __init__(self, count: int, size: int = 100) -> None:
        self.count = count
        self.size = size
        self.produced = 0

    async def handler(self, payload: msgspec.Raw, context: RequestContext) -> AsyncIterator[bytes]:
        for number in range(self.count):
            await asyncio.sleep(0)
            self.produced += 1
            yield encode([number, "x" * self.size])


async def spied_client(nc: NATS, worker: NATS, sizes: list[int]) -> RequestClient:
    """A started client (window 2, silence timeout 1 s) whose frames' sizes are put in ``sizes``."""
    client = RequestClient(nc, window=2, silence_timeout=1.0)
    await client.start()

    async def spy(msg: Msg) -> None:
        sizes.append(len(msg.data))

    await worker.subscribe(f"{client._prefix}.*", cb=spy)
    await flush(worker)
    return client


async def test_a_long_output_behind_a_full_window_arrives_whole_in_frames_under_max_payload(
    connections: tuple[NATS, NATS],
) -> None:
    worker, nc = connections
    outputs = Outputs(600)  # about 70 KB: many frames' worth
    server = EndpointServer(worker, SUBJECT, outputs.handler)
    await server.start()
    sizes: list[int] = []
    client = await spied_client(nc, worker, sizes)
    stream = client.call(SUBJECT, "long", encode(None))
    first = await anext(stream)
    await asyncio.sleep(0.5)  # the reader takes nothing meanwhile: the window stays full
    rest = [payload async for frame in stream for payload in frame]
    received = [msgspec.msgpack.decode(payload)[0] for payload in first + rest]
    assert received == list(range(600))
    assert sizes and max(sizes) <= MAX_PAYLOAD
    await server.close()
    await client.close()


async def test_the_handler_waits_while_a_frames_worth_of_outputs_waits_for_the_window(
    connections: tuple[NATS, NATS],
) -> None:
    worker, nc = connections
    outputs = Outputs(10_000)  # about 1 MB
    server = EndpointServer(worker, SUBJECT, outputs.handler)
    await server.start()
    sizes: list[int] = []
    client = await spied_client(nc, worker, sizes)
    stream = client.call(SUBJECT, "bounded", encode(None))
    count = len(await anext(stream))
    await asyncio.sleep(0.5)
    # Two frames in flight, one frame's worth waiting on the worker (a frame holds ~37 outputs).
    assert outputs.produced < 200
    async for frame in stream:
        count += len(frame)
    assert count == outputs.produced == 10_000
    assert max(sizes) <= MAX_PAYLOAD
    await server.close()
    await client.close()


async def test_an_output_alone_over_max_payload_fails_the_request_at_once(connections: tuple[NATS, NATS]) -> None:
    worker, nc = connections
    outputs = Outputs(3, size=2 * MAX_PAYLOAD)
    server = EndpointServer(worker, SUBJECT, outputs.handler)
    await server.start()
    client = RequestClient(nc, silence_timeout=60)
    await client.start()

    async def read_all() -> None:
        async with asyncio.timeout(10):  # far below the silence timeout
            async for _ in client.call(SUBJECT, "huge", encode(None)):
                pass

    with pytest.raises(RemoteError, match="over the NATS payload limit"):
        await read_all()
    await server.close()
    await client.close()
