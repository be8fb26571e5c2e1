"""Streams whose client is gone (killed, cut off, or its Stop lost) stop generating on the worker.

Only a Stop used to end a stream early: the flow-control window held back frames, not the engine,
so a vanished ingress left its streams generating to max_tokens for nobody.
"""

import asyncio
from collections.abc import AsyncIterator

import msgspec
from nats.aio.client import Client as NATS

from runtime.cluster.nats_connection import connect_nats, flush
from runtime.engine import RequestContext
from runtime.request_plane import EndpointServer, Envelope, RequestClient
from tests.infra import NatsServer

SUBJECT = "flotilla.test.backend.generate.1"
MAX_TOKENS = 100_000  # about two minutes at this engine's pace: far more than any test waits
encode = msgspec.msgpack.encode


class Engine:
    """A handler that generates ~1,000 tokens/s per request and records how each request ended."""

    def __init__(self) -> None:
        self.generated: dict[str, int] = {}
        self.aborted: dict[str, bool] = {}  # request id -> whether context.stopped was set when it ended
        self.ended: dict[str, asyncio.Event] = {}

    def event(self, request_id: str) -> asyncio.Event:
        return self.ended.setdefault(request_id, asyncio.Event())

    async def handler(self, payload: msgspec.Raw, context: RequestContext) -> AsyncIterator[bytes]:
        request_id = context.request_id
        self.generated[request_id] = 0
        try:
            for number in range(msgspec.msgpack.decode(payload)):
                if context.stopped:
                    return
                await asyncio.sleep(0.001)
                self.generated[request_id] += 1
                yield encode(number)
        finally:
            self.aborted[request_id] = context.stopped
            self.event(request_id).set()


async def serve(nc: NATS, engine: Engine, **options: float) -> EndpointServer:
    server = EndpointServer(nc, SUBJECT, engine.handler, **options)  # type: ignore[arg-type]
    await server.start()
    return server


async def test_a_client_whose_connection_dies_has_its_streams_stopped_and_their_engine_requests_aborted(
    nats_server: NatsServer,
) -> None:
    worker = await connect_nats(nats_server.url, name="worker")
    doomed = await connect_nats(nats_server.url, name="doomed ingress")
    engine = Engine()
    server = await serve(worker, engine, ack_deadline=0.5)
    client = RequestClient(doomed, window=4, silence_timeout=60)
    await client.start()
    streams = [client.call(SUBJECT, f"z{number}", encode(MAX_TOKENS)) for number in range(3)]
    for stream in streams:
        await anext(stream)
    await doomed.close()  # to nats-server, as if the ingress had been killed: no Stop, no more acks
    for number in range(3):
        async with asyncio.timeout(15):  # the deadline is 0.5 s; generating to max_tokens takes minutes
            await engine.event(f"z{number}").wait()
        assert engine.aborted[f"z{number}"]
        assert engine.generated[f"z{number}"] < MAX_TOKENS // 10
    assert server.active_requests == 0
    await server.close()
    await worker.close()


async def test_a_stream_its_client_forgot_is_stopped_while_the_clients_other_streams_go_on(
    nats_server: NatsServer,
) -> None:
    # A Stop lost on the way (the worker's connection blipped) leaves a stream its client no longer
    # reads or probes for, while the same client keeps reading, and probing for, its other streams.
    worker = await connect_nats(nats_server.url, name="worker")
    nc = await connect_nats(nats_server.url, name="ingress")
    engine = Engine()
    server = await serve(worker, engine, ack_deadline=0.5)
    client = RequestClient(nc, window=4, probe_interval=0.1, silence_timeout=60)
    await client.start()
    await nc.publish(SUBJECT, encode(Envelope("forgotten", msgspec.Raw(encode(MAX_TOKENS)), 4)), reply="gone.1")
    await flush(nc)
    # The live stream is not read for ten deadlines: its window is full, but its client is there.
    live = client.call(SUBJECT, "live", encode(3000))
    first = await anext(live)
    async with asyncio.timeout(15):
        await engine.event("forgotten").wait()
    assert engine.aborted["forgotten"]
    assert engine.generated["forgotten"] < MAX_TOKENS // 10
    await asyncio.sleep(5 * 0.5)  # generating 3,000 tokens takes over 3 s: the window stays full meanwhile
    rest = [payload async for frame in live for payload in frame]
    assert [msgspec.msgpack.decode(payload) for payload in first + rest] == list(range(3000))
    assert not engine.aborted["live"]
    await server.close()
    await client.close()
    await worker.close()
    await nc.close()
