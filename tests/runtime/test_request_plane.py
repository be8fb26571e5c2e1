"""The request plane over a real NATS server: streams, stops, silence, refusals, flow control, death, drain."""

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from runtime.cluster.nats_connection import connect_nats, flush
from runtime.engine import RequestContext
from runtime.errors import RequestRejected
from runtime.request_plane import (
    CUT,
    DATA,
    END,
    ERROR,
    HEARTBEAT,
    EndpointServer,
    Frame,
    Probe,
    RemoteError,
    RequestClient,
    RequestRefused,
    RequestTooLarge,
    StreamBroken,
    WorkerUnavailable,
)
from runtime.request_plane.flow import take_following
from runtime.request_plane.liveness import Inbox
from runtime.request_plane.loop_bound import SingleReaderQueue
from tests.infra import NatsServer

SUBJECT = "flotilla.test.backend.generate.1"


encode = msgspec.msgpack.encode


async def count(payload: msgspec.Raw, context: RequestContext) -> AsyncIterator[bytes]:
    for number in range(msgspec.msgpack.decode(payload)):
        if context.stopped:
            return
        await asyncio.sleep(0)
        yield encode(number)


async def items(frames: AsyncIterator[list[msgspec.Raw]]) -> list[object]:
    """Every payload of a stream, decoded, in order."""
    return [msgspec.msgpack.decode(payload) async for frame in frames for payload in frame]


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
    assert await items(client.call(SUBJECT, "a", encode(200))) == list(range(200))
    await server.close()


async def test_a_subject_nobody_serves_is_worker_unavailable(connections: tuple[NATS, NATS]) -> None:
    client = RequestClient(connections[1])
    await client.start()
    with pytest.raises(WorkerUnavailable, match="no instance listens"):
        await anext(client.call("flotilla.test.backend.generate.ff", "b", encode(1)))


async def test_closing_the_stream_stops_the_handler(connections: tuple[NATS, NATS]) -> None:
    worker, nc = connections
    stopped = asyncio.Event()

    async def endless(payload: msgspec.Raw, context: RequestContext) -> AsyncIterator[bytes]:
        try:
            while True:
                await asyncio.sleep(0.01)
                yield encode("x")
        finally:
            stopped.set()

    server = await serve(worker, endless)
    client = RequestClient(nc)
    await client.start()
    stream = client.call(SUBJECT, "c", encode(None))
    await anext(stream)
    await stream.aclose()
    await asyncio.wait_for(stopped.wait(), 5)
    assert server.active_requests == 0
    await server.close()


async def test_a_handler_error_reaches_the_client(connections: tuple[NATS, NATS]) -> None:
    worker, nc = connections

    async def broken(payload: msgspec.Raw, context: RequestContext) -> AsyncIterator[bytes]:
        yield encode("first")
        raise ValueError("the engine broke")

    server = await serve(worker, broken)
    client = RequestClient(nc)
    await client.start()
    received: list[object] = []

    async def collect() -> None:
        async for frame in client.call(SUBJECT, "d", encode(None)):
            received.extend(msgspec.msgpack.decode(payload) for payload in frame)

    with pytest.raises(RemoteError, match="the engine broke"):
        await collect()
    assert received == ["first"]
    await server.close()


async def test_an_engines_refusal_of_the_request_reaches_the_client_as_a_refusal(
    connections: tuple[NATS, NATS],
) -> None:
    """An engine's RequestRejected (SGLang's ValueError for a prompt over its context length, say) is the client's
    error: its ingress answers 400, so the worker codes it, unlike an engine that broke."""
    worker, nc = connections

    async def refusing(payload: msgspec.Raw, context: RequestContext) -> AsyncIterator[bytes]:
        raise RequestRejected("SGLang refused the request: the input is longer than the context length")
        yield b""  # an async generator, as every handler is

    server = await serve(worker, refusing)
    client = RequestClient(nc)
    await client.start()
    with pytest.raises(RequestRefused, match="longer than the context length"):
        await items(client.call(SUBJECT, "d", encode(None)))
    await server.close()


async def outlives_silences(
    nc: NATS, worker: NATS, *, heartbeat_interval: float, silence_timeout: float
) -> RequestClient:
    """Serve a request that yields only when released; check it survives several silence timeouts.

    Returns the (started) client for more checks.
    """
    release = asyncio.Event()

    async def slow(payload: msgspec.Raw, context: RequestContext) -> AsyncIterator[bytes]:
        await release.wait()
        yield encode("late")

    server = await serve(worker, slow, heartbeat_interval=heartbeat_interval)
    client = RequestClient(nc, silence_timeout=silence_timeout)
    await client.start()
    stream = client.call(SUBJECT, "slow", encode(None))
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(4 * silence_timeout)
    assert not first.done()
    release.set()
    assert msgspec.msgpack.decode((await first)[0]) == "late"
    await stream.aclose()
    await server.close()
    return client


async def test_heartbeats_keep_a_slow_stream_alive_and_silence_breaks_it(connections: tuple[NATS, NATS]) -> None:
    worker, nc = connections
    client = await outlives_silences(nc, worker, heartbeat_interval=0.05, silence_timeout=0.3)
    # A hung worker: it takes the request and then answers nothing, not even probes.
    hung = [await worker.subscribe(subject) for subject in (SUBJECT, SUBJECT + ".control")]
    await flush(worker)
    with pytest.raises(StreamBroken, match="went silent"):
        await anext(client.call(SUBJECT, "f", encode(None)))
    for subscription in hung:
        await subscription.unsubscribe()


async def test_a_worker_that_says_it_runs_the_request_is_waited_for_without_heartbeats(
    connections: tuple[NATS, NATS],
) -> None:
    # An overloaded worker may send nothing for longer than the silence timeout; it is slow, not gone.
    worker, nc = connections
    await outlives_silences(nc, worker, heartbeat_interval=60, silence_timeout=0.2)


async def test_a_request_the_worker_never_took_is_unavailable_there_so_another_instance_takes_it(
    connections: tuple[NATS, NATS],
) -> None:
    # The worker answers probes but never got the request (lost on its way in, as a worker stopping dropped
    # what NATS had delivered to it): nothing was generated, so it is no migration, but a refusal.
    worker, nc = connections

    async def answer_probe(msg: Msg) -> None:
        probe = msgspec.msgpack.decode(msg.data, type=Probe)
        await worker.publish(msg.reply, msgspec.msgpack.encode(probe.request_ids))

    lost = [await worker.subscribe(SUBJECT), await worker.subscribe(SUBJECT + ".control", cb=answer_probe)]
    await flush(worker)
    client = RequestClient(nc, silence_timeout=0.2)
    await client.start()
    with pytest.raises(WorkerUnavailable, match="never took the request"):
        async with asyncio.timeout(10):
            await anext(client.call(SUBJECT, "h", encode(None)))
    for subscription in lost:
        await subscription.unsubscribe()


async def test_a_request_the_worker_forgot_after_sending_part_of_it_is_a_broken_stream(
    connections: tuple[NATS, NATS],
) -> None:
    # Outputs went out, then the worker lost the request (restarted under the same subject): the client
    # saw tokens, so only a migration may carry the request on.
    worker, nc = connections

    async def take_and_forget(msg: Msg) -> None:
        await worker.publish(msg.reply, msgspec.msgpack.encode(Frame(DATA, 1, payloads=[msgspec.Raw(encode(0))])))

    async def answer_probe(msg: Msg) -> None:
        probe = msgspec.msgpack.decode(msg.data, type=Probe)
        await worker.publish(msg.reply, msgspec.msgpack.encode(probe.request_ids))

    forgetful = [
        await worker.subscribe(SUBJECT, cb=take_and_forget),
        await worker.subscribe(SUBJECT + ".control", cb=answer_probe),
    ]
    await flush(worker)
    client = RequestClient(nc, silence_timeout=0.2)
    await client.start()
    stream = client.call(SUBJECT, "g", encode(None))
    assert [msgspec.msgpack.decode(payload) for payload in await anext(stream)] == [0]
    with pytest.raises(StreamBroken, match="went silent"):
        async with asyncio.timeout(10):
            await anext(stream)
    await stream.aclose()
    for subscription in forgetful:
        await subscription.unsubscribe()


async def test_a_malformed_frame_fails_the_request_at_once(connections: tuple[NATS, NATS]) -> None:
    worker, nc = connections

    async def answer_garbage(msg: object) -> None:
        await worker.publish(msg.reply, b"\xc1 not a frame")  # type: ignore[attr-defined]

    await worker.subscribe(SUBJECT, cb=answer_garbage)
    await flush(worker)
    client = RequestClient(nc, silence_timeout=60)
    await client.start()
    with pytest.raises(RemoteError, match="malformed frame"):
        await asyncio.wait_for(anext(client.call(SUBJECT, "g", encode(None))), 5)


async def test_a_slow_reader_makes_the_worker_coalesce_its_frames(connections: tuple[NATS, NATS]) -> None:
    worker, nc = connections
    produced = asyncio.Event()

    async def fast(payload: msgspec.Raw, context: RequestContext) -> AsyncIterator[bytes]:
        for number in range(300):
            await asyncio.sleep(0)  # a step boundary: without flow control each item leaves as its own frame
            yield encode(number)
        produced.set()

    server = await serve(worker, fast)
    client = RequestClient(nc, window=4)
    await client.start()
    # Counted where the worker publishes them: the reader joins frames that wait for it (see the next test). No
    # callback: the copies wait in the subscription's queue, counted once a round trip has delivered them all (a
    # callback's task may not have run yet when the stream ends, on a loaded machine).
    spy = await worker.subscribe(f"{client._prefix}.*")
    await flush(worker)
    stream = client.call(SUBJECT, "w", encode(None))
    frames = [await anext(stream)]
    await produced.wait()  # the reader takes nothing more until the worker has produced everything
    frames += [frame async for frame in stream]
    assert [msgspec.msgpack.decode(payload) for frame in frames for payload in frame] == list(range(300))
    await flush(worker)  # what the worker published before it is in the spy's queue after it
    # At most: the window, one more for the single frame taken (and acknowledged), and the END frame.
    assert 2 <= spy.pending_msgs <= 4 + 1 + 1
    await server.close()


async def test_a_reader_that_lags_takes_the_frames_waiting_for_it_in_one_piece(
    connections: tuple[NATS, NATS],
) -> None:
    worker, nc = connections
    ended = asyncio.Event()
    sent: list[Msg] = []

    async def spaced(payload: msgspec.Raw, context: RequestContext) -> AsyncIterator[bytes]:
        for number in range(6):
            if number:
                await asyncio.sleep(0.005)  # each item leaves the worker as a frame of its own
            yield encode(number)

    async def spy(msg: Msg) -> None:
        # Subscribed after the client's inbox on the same connection: called after it for each message.
        sent.append(msg)
        if len(sent) == 6:
            ended.set()

    server = await serve(worker, spaced)
    client = RequestClient(nc)
    await client.start()
    await nc.subscribe(f"{client._prefix}.*", cb=spy)
    await flush(nc)
    stream = client.call(SUBJECT, "lag", encode(None))
    first = await anext(stream)
    await ended.wait()  # five more frames (DATA, ..., END) wait in the stream's queue, unread
    rest = [frame async for frame in stream]
    assert len(sent) == 6
    assert [msgspec.msgpack.decode(payload) for payload in first] == [0]
    assert [[msgspec.msgpack.decode(payload) for payload in frame] for frame in rest] == [[1, 2, 3, 4, 5]]
    await server.close()


async def test_joining_frames_stops_at_a_heartbeat_a_gap_a_silence_or_after_the_end() -> None:
    def queue_of(*frames: Frame | None) -> SingleReaderQueue[Frame | None]:
        queue: SingleReaderQueue[Frame | None] = SingleReaderQueue()
        for frame in frames:
            queue.put_nowait(frame)
        return queue

    def data(seq: int) -> Frame:
        return Frame(DATA, seq, [msgspec.Raw(encode(seq))])

    payloads = [msgspec.Raw(encode(1))]
    queue = queue_of(data(2), data(3), Frame(END, 4, [msgspec.Raw(encode(4))]), data(5))
    assert take_following(queue, payloads, 2) == (5, END)
    assert [msgspec.msgpack.decode(payload) for payload in payloads] == [1, 2, 3, 4]
    assert queue.qsize() == 1  # nothing after the end is taken
    for stop in (Frame(HEARTBEAT, 2), data(3), None, Frame(ERROR, 2, error="failed"), Frame(CUT, 2)):
        payloads = [msgspec.Raw(encode(1))]
        queue = queue_of(stop)
        assert take_following(queue, payloads, 2) == (2, DATA)
        assert len(payloads) == 1 and queue.qsize() == 1


async def test_a_request_over_the_size_limit_is_refused_as_too_large(connections: tuple[NATS, NATS]) -> None:
    worker, nc = connections
    server = await serve(worker, count, max_request_bytes=1024)
    client = RequestClient(nc)
    await client.start()
    with pytest.raises(RequestTooLarge, match="over the limit of 1024"):
        await anext(client.call(SUBJECT, "big", encode("x" * 2000)))
    await server.close()


async def endless(payload: msgspec.Raw, context: RequestContext) -> AsyncIterator[bytes]:
    while True:
        await asyncio.sleep(0.01)
        yield encode("x")


async def drain_stream(stream: AsyncIterator[list[msgspec.Raw]]) -> None:
    async for _ in stream:
        pass


async def test_a_worker_whose_connection_closes_breaks_its_streams_long_before_the_silence_timeout(
    nats_server: NatsServer,
) -> None:
    doomed = await connect_nats(nats_server.url, name="doomed worker")
    nc = await connect_nats(nats_server.url, name="client")
    server = await serve(doomed, endless)
    client = RequestClient(nc, silence_timeout=60, probe_interval=0.1)
    await client.start()
    stream = client.call(SUBJECT, "k", encode(None))
    await anext(stream)
    await doomed.close()  # to nats-server, as if the worker's process had been killed
    with pytest.raises(StreamBroken, match="is gone"):
        async with asyncio.timeout(10):  # far below the 60 s silence timeout
            await drain_stream(stream)
    await server.close()
    await client.close()
    await nc.close()


async def test_a_draining_worker_refuses_new_requests_and_lets_running_ones_finish(
    connections: tuple[NATS, NATS],
) -> None:
    worker, nc = connections
    release = asyncio.Event()

    async def waits(payload: msgspec.Raw, context: RequestContext) -> AsyncIterator[bytes]:
        yield encode("started")
        await release.wait()
        yield encode("done")

    server = await serve(worker, waits)
    client = RequestClient(nc, silence_timeout=60)
    await client.start()
    stream = client.call(SUBJECT, "r1", encode(None))
    assert msgspec.msgpack.decode((await anext(stream))[0]) == "started"
    await server.stop_taking_requests()
    drain = asyncio.create_task(server.drain(grace=60))
    with pytest.raises(WorkerUnavailable):
        await anext(client.call(SUBJECT, "r2", encode(None)))
    release.set()
    assert await items(stream) == ["done"]
    assert await drain == 0
    await server.close()


async def test_streams_still_running_when_the_drain_ends_are_cut_at_once(connections: tuple[NATS, NATS]) -> None:
    worker, nc = connections
    server = await serve(worker, endless)
    client = RequestClient(nc, silence_timeout=60)
    await client.start()
    stream = client.call(SUBJECT, "s", encode(None))
    await anext(stream)
    assert await server.drain(grace=0) == 1
    with pytest.raises(StreamBroken, match="shut down"):
        async with asyncio.timeout(10):  # far below the 60 s silence timeout
            await drain_stream(stream)
    await server.close()


async def test_a_client_behind_on_its_own_reading_does_not_call_a_worker_silent() -> None:
    # An overloaded ingress reads NATS late: frames and heartbeats wait unread in its own queue or in
    # the server's buffers. Its silence watchdog must wait until it has caught up (a PING round trip),
    # or it fails streams whose workers are alive.
    behind = True

    async def caught_up() -> bool:
        return not behind

    inbox = Inbox(0.05, caught_up)
    try:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(inbox.queue.get(), 0.4)
        behind = False
        assert await asyncio.wait_for(inbox.queue.get(), 5) is None  # now the silence counts
    finally:
        inbox.close()
