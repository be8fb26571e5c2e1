"""A worker's NATS connection that drops for half a second does not break its streams.

While the worker is disconnected, nobody listens on its subjects and NATS answers the client's probes
"no responders". The client used to cut every stream to that worker at the first such answer; now
only answers that come back to back for about a second count. The frames on their way when the
connection was reset are lost: the worker sends them again once it has reconnected, and the client,
which used to break the stream at the gap, waits for them.
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator

import msgspec
import pytest

from runtime.cluster.nats_connection import connect_nats
from runtime.engine import RequestContext
from runtime.request_plane import EndpointServer, RequestClient, StreamBroken
from runtime.request_plane.liveness import ProbeFailures
from tests.infra import NatsServer
from tests.servers import free_port

SUBJECT = "flotilla.test.backend.generate.1"
encode = msgspec.msgpack.encode


class Proxy:
    """A TCP relay to nats-server whose connections can be cut, with new ones refused for a while."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._refusing = False
        self._swallowing = False

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def cut(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()  # a reset, as a cable pulled out looks once noticed
        self._writers.clear()

    async def blip(self, seconds: float, *, swallow: float = 0.0) -> None:
        """Cut every connection and refuse new ones for ``seconds``. With ``swallow``, first drop what the
        clients send for that long: what a reset loses on its way (in buffers, on the wire), for sure."""
        if swallow:
            self._swallowing = True
            await asyncio.sleep(swallow)
        self._refusing = True
        self.cut()
        self._swallowing = False
        await asyncio.sleep(seconds)
        self._refusing = False

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._refusing:
            writer.transport.abort()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self._writers |= {writer, up_writer}

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter, *, upstream: bool) -> None:
            with contextlib.suppress(OSError):
                while data := await source.read(65536):
                    if upstream and self._swallowing:
                        continue
                    sink.write(data)
                    await sink.drain()
            sink.transport.abort()

        await asyncio.gather(pipe(reader, up_writer, upstream=True), pipe(up_reader, writer, upstream=False))


@pytest.fixture
async def proxy(nats_server: NatsServer) -> AsyncIterator[Proxy]:
    relay = Proxy(nats_server.port)
    await relay.start()
    yield relay
    await relay.close()


async def test_streams_to_a_worker_whose_connection_blips_for_half_a_second_go_on(
    nats_server: NatsServer, proxy: Proxy
) -> None:
    reconnected = asyncio.Event()

    async def on_event(event: str) -> None:
        if event == "reconnected":
            reconnected.set()

    worker = await connect_nats(proxy.url, name="worker", on_event=on_event)
    nc = await connect_nats(nats_server.url, name="ingress")
    release = asyncio.Event()

    async def waits(payload: msgspec.Raw, context: RequestContext) -> AsyncIterator[bytes]:
        yield encode("started")
        await release.wait()  # nothing in flight while the connection is down
        yield encode("done")

    server = EndpointServer(worker, SUBJECT, waits)
    await server.start()
    # Probes every 0.1 s: several fall in the blip, each answered "no responders".
    client = RequestClient(nc, probe_interval=0.1, silence_timeout=60)
    await client.start()
    streams = [client.call(SUBJECT, f"b{number}", encode(None)) for number in range(5)]
    for stream in streams:
        assert msgspec.msgpack.decode((await anext(stream))[0]) == "started"
    await proxy.blip(0.5)
    async with asyncio.timeout(10):
        await reconnected.wait()
    await asyncio.sleep(0.3)  # probes answered again after the reconnection
    release.set()
    for stream in streams:
        assert [msgspec.msgpack.decode(payload) async for frame in stream for payload in frame] == ["done"]
    await server.close()
    await client.close()
    await worker.close()
    await nc.close()


async def test_frames_lost_with_a_reset_connection_are_sent_again_and_the_streams_go_on(
    nats_server: NatsServer, proxy: Proxy
) -> None:
    worker = await connect_nats(proxy.url, name="worker")
    nc = await connect_nats(nats_server.url, name="ingress")

    async def counts(payload: msgspec.Raw, context: RequestContext) -> AsyncIterator[bytes]:
        for number in range(300):
            await asyncio.sleep(0.005)
            yield encode(number)

    server = EndpointServer(worker, SUBJECT, counts)
    await server.start()
    client = RequestClient(nc, probe_interval=0.1, silence_timeout=10)
    await client.start()
    streams = [client.call(SUBJECT, f"r{number}", encode(None)) for number in range(5)]
    firsts = [await anext(stream) for stream in streams]

    async def read_all(first: list[msgspec.Raw], stream: AsyncIterator[list[msgspec.Raw]]) -> list[int]:
        return [
            msgspec.msgpack.decode(payload)
            for frame in [first] + [frame async for frame in stream]
            for payload in frame
        ]

    readers = [asyncio.create_task(read_all(first, stream)) for first, stream in zip(firsts, streams, strict=True)]
    # Whatever the worker sends for 0.1 s is lost, then its connection is reset and it reconnects.
    await proxy.blip(0.5, swallow=0.1)
    async with asyncio.timeout(30):
        outputs = await asyncio.gather(*readers)
    assert outputs == [list(range(300))] * 5  # nothing missing, nothing twice
    await server.close()
    await client.close()
    await worker.close()
    await nc.close()


async def test_a_worker_whose_connection_stays_gone_has_its_streams_cut_after_about_a_second(
    nats_server: NatsServer, proxy: Proxy
) -> None:
    worker = await connect_nats(proxy.url, name="worker")
    nc = await connect_nats(nats_server.url, name="ingress")

    async def endless(payload: msgspec.Raw, context: RequestContext) -> AsyncIterator[bytes]:
        while True:
            await asyncio.sleep(0.01)
            yield encode("x")

    server = EndpointServer(worker, SUBJECT, endless)
    await server.start()
    client = RequestClient(nc, probe_interval=0.1, silence_timeout=60)
    await client.start()
    stream = client.call(SUBJECT, "gone", encode(None))
    await anext(stream)
    blip = asyncio.create_task(proxy.blip(30))

    async def read_all() -> None:
        async with asyncio.timeout(10):  # far below the 60 s silence timeout
            async for _ in stream:
                pass

    with pytest.raises(StreamBroken, match="is gone"):
        await read_all()
    blip.cancel()
    await server.close()
    await client.close()
    with contextlib.suppress(OSError):  # the connection it had was reset under it
        await worker.close()
    await nc.close()


def test_no_responders_count_only_back_to_back_and_for_the_whole_span() -> None:
    failures = ProbeFailures(1.0)
    assert not failures.failed("w1", 10.0)
    assert not failures.failed("w1", 10.6)
    failures.clear("w1")  # answered: the half second of "no responders" was a blip
    assert not failures.failed("w1", 11.0)
    assert not failures.failed("w2", 11.5)  # each instance on its own
    assert not failures.failed("w1", 11.9)
    assert failures.failed("w1", 12.0)
