"""A stream whose engine makes no progress fails after the progress deadline, and a worker whose queue is
full refuses new requests as busy.

Heartbeats prove that a worker's event loop runs, not that its engine does: a stream whose engine was
stuck used to wait for ever, its heartbeats arriving on time.
"""

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from runtime.cluster.nats_connection import connect_nats
from runtime.engine import RequestContext
from runtime.request_plane import (
    DATA,
    EndpointServer,
    Frame,
    RequestClient,
    StreamBroken,
    StreamStalled,
    WorkerBusy,
    control_subject,
)
from tests.infra import NatsServer

SUBJECT = "flotilla.test.backend.generate.1"
encode = msgspec.msgpack.encode


class Engine:
    """Each request yields ``outputs`` outputs, one per ``pace`` s, then hangs when told to (its engine
    stuck, the worker's event loop still running)."""

    def __init__(self, *, pace: float = 0.01) -> None:
        self.pace = pace
        self.stuck = asyncio.Event()  # set: every request hangs before its next output
        self.stopped: dict[str, bool] = {}

    async def handler(self, payload: msgspec.Raw, context: RequestContext) -> AsyncIterator[bytes]:
        try:
            for number in range(msgspec.msgpack.decode(payload)):
                if self.stuck.is_set():
                    await asyncio.Event().wait()
                await asyncio.sleep(self.pace)
                yield encode(number)
        finally:
            self.stopped[context.request_id] = context.stopped


@pytest.fixture
async def worker(nats_server: NatsServer) -> AsyncIterator[NATS]:
    nc = await connect_nats(nats_server.url, name="worker")
    yield nc
    await nc.close()


@pytest.fixture
async def ingress(nats_server: NatsServer) -> AsyncIterator[NATS]:
    nc = await connect_nats(nats_server.url, name="ingress")
    yield nc
    await nc.close()


async def serve(nc: NATS, engine: Engine, **options: object) -> EndpointServer:
    server = EndpointServer(nc, SUBJECT, engine.handler, heartbeat_interval=0.1, **options)  # type: ignore[arg-type]
    await server.start()
    return server


async def test_a_stream_whose_engine_is_stuck_fails_as_stalled_and_its_worker_is_avoided(
    worker: NATS, ingress: NATS
) -> None:
    engine = Engine()
    server = await serve(worker, engine)
    client = RequestClient(ingress, silence_timeout=60, progress_deadline=0.5)
    await client.start()
    stream = client.call(SUBJECT, "r1", encode(1_000_000))
    await anext(stream)
    engine.stuck.set()
    async with asyncio.timeout(20):  # the deadline is 0.5 s; without it the stream waits for ever
        with pytest.raises(StreamStalled, match=r"no output for 0\.5 s"):
            async for _ in stream:
                pass
    assert client.avoided(SUBJECT)
    await asyncio.sleep(0.1)  # the Stop travels to the worker, which aborts the engine request
    assert server.active_requests == 0
    await client.close()
    await server.close()


async def test_a_frozen_worker_is_given_half_a_silence_timeout_to_answer_once_silent_on_every_stream(
    worker: NATS, ingress: NATS
) -> None:
    # A worker frozen with its connection open: it sent one output, then nothing, and its probes go
    # unanswered (someone listens, so NATS does not say "no responders"). Its probe used to get six
    # silence timeouts.
    async def answer_once(msg: Msg) -> None:
        await worker.publish(msg.reply, encode(Frame(DATA, 1, [msgspec.Raw(encode(0))])))

    async def ignore(msg: Msg) -> None:
        return None

    await worker.subscribe(SUBJECT, cb=answer_once)
    await worker.subscribe(control_subject(SUBJECT), cb=ignore)
    await worker.flush()
    client = RequestClient(ingress, silence_timeout=1.0)
    await client.start()
    stream = client.call(SUBJECT, "r1", encode(10))
    await anext(stream)
    started = time.monotonic()
    with pytest.raises(StreamBroken, match="went silent"):
        await anext(stream)
    assert time.monotonic() - started < 5  # 1 s of silence and 0.5 s for the probe (7 s before)
    await client.close()


async def test_a_request_waiting_its_turn_is_not_stalled_while_the_engine_works_for_others(
    worker: NATS, ingress: NATS
) -> None:
    release = asyncio.Event()

    class Queued(Engine):
        async def handler(self, payload: msgspec.Raw, context: RequestContext) -> AsyncIterator[bytes]:
            if context.request_id == "queued":
                await release.wait()  # its turn comes when the busy one is done
            async for output in super().handler(payload, context):
                yield output

    server = await serve(worker, Queued(pace=0.02))
    client = RequestClient(ingress, silence_timeout=60, progress_deadline=0.5)
    await client.start()
    queued = client.call(SUBJECT, "queued", encode(3))
    waiting = asyncio.ensure_future(anext(queued))
    await asyncio.sleep(0)
    # ~2 s: four deadlines. A frame carries a frame's worth of outputs (two when the worker's loop was late).
    other = [output async for frame in client.call(SUBJECT, "other", encode(100)) for output in frame]
    release.set()
    await waiting
    assert [msgspec.msgpack.decode(output) for output in other] == list(range(100))
    assert [output async for output in queued]  # it ran to its end
    await client.close()
    await server.close()


async def test_a_worker_whose_queue_is_full_refuses_as_busy_and_takes_requests_again_once_it_empties(
    worker: NATS, ingress: NATS
) -> None:
    engine = Engine(pace=0.05)
    server = await serve(worker, engine, max_waiting=1)
    client = RequestClient(ingress, silence_timeout=60)
    await client.start()
    first = client.call(SUBJECT, "first", encode(10))
    await anext(first)
    with pytest.raises(WorkerBusy, match="is busy: 1 request"):
        await anext(client.call(SUBJECT, "second", encode(10)))
    assert server.refused_busy == 1
    async for _ in first:
        pass
    assert [output async for output in client.call(SUBJECT, "third", encode(2))]
    await client.close()
    await server.close()
