"""The NATS connection says what goes wrong on it: messages dropped by a slow subscription are a warning."""

import asyncio
import logging
import os
import signal

import pytest
from nats.aio.msg import Msg

from runtime.cluster.nats_connection import close_nats, connect_nats, consume, flush
from tests.infra import NatsServer


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self.arrived = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        self.arrived.set()


async def test_messages_dropped_by_a_slow_subscription_are_reported(nats_server: NatsServer) -> None:
    warnings = _Warnings()
    logger = logging.getLogger("runtime.cluster.nats_connection")
    logger.addHandler(warnings)
    level = logger.level
    logger.setLevel(logging.WARNING)  # earlier tests may have configured logging more quietly
    nc = await connect_nats(nats_server.url, name="slow reader")
    release = asyncio.Event()

    async def stuck(_: object) -> None:
        await release.wait()

    try:
        await nc.subscribe("slow", cb=stuck, pending_msgs_limit=2)
        for number in range(10):
            await nc.publish("slow", str(number).encode())
        await flush(nc)
        async with asyncio.timeout(5):
            await warnings.arrived.wait()
        assert len(warnings.messages) == 1  # one report, not one line per message
        assert "reads too slowly" in warnings.messages[0] and "subject slow" in warnings.messages[0]
    finally:
        release.set()
        logger.removeHandler(warnings)
        logger.setLevel(level)
        await nc.close()


async def test_a_flush_that_times_out_leaves_the_connection_reading(nats_server: NatsServer) -> None:
    # nats-py's own flush(timeout) cancels the PONG's future; the late PONG then stops its reader.
    nc = await connect_nats(nats_server.url, name="flusher")
    received = asyncio.Queue[bytes]()

    async def on_message(msg: Msg) -> None:
        await received.put(msg.data)

    try:
        await nc.subscribe("after", cb=on_message)
        with pytest.raises(TimeoutError):
            await flush(nc, within=1e-6)  # the PONG cannot be back this soon
        await flush(nc)  # the late PONG has arrived by now
        await nc.publish("after", b"still reading")
        async with asyncio.timeout(5):
            assert await received.get() == b"still reading"
    finally:
        await nc.close()


async def test_a_flush_sends_its_ping_after_what_was_sent_before(nats_server: NatsServer) -> None:
    # nats-py's own flush writes the PING to the socket at once, ahead of a SUB still in its buffer
    # (here: while its flusher task waits on a slow socket): the PONG would then confirm a
    # subscription the server has not seen yet.
    nc = await connect_nats(nats_server.url, name="ordered")
    wire: list[bytes] = []
    transport = nc._transport
    assert transport is not None
    write, writelines, drain = transport.write, transport.writelines, transport.drain
    slow_once = [True]

    def recorded_write(payload: bytes) -> None:
        wire.append(bytes(payload))
        write(payload)

    def recorded_writelines(payload: list[bytes]) -> None:
        wire.extend(bytes(part) for part in payload)
        writelines(payload)

    async def slow_drain() -> None:
        if slow_once[0]:
            slow_once[0] = False
            await asyncio.sleep(0.1)
        await drain()

    try:
        transport.write = recorded_write  # type: ignore[method-assign]
        transport.writelines = recorded_writelines  # type: ignore[method-assign]
        transport.drain = slow_drain  # type: ignore[method-assign]
        await nc.publish("ordered.before", b"x")
        await asyncio.sleep(0.01)  # the flusher wrote the publish and now waits on the socket
        await nc.subscribe("ordered.subject")  # queued behind it in nats-py's buffer
        await flush(nc)
        sent = b"".join(wire)
        assert b"SUB ordered.subject" in sent and b"PING" in sent
        assert sent.index(b"SUB ordered.subject") < sent.index(b"PING")
    finally:
        transport.write, transport.writelines, transport.drain = write, writelines, drain  # type: ignore[method-assign]
        await nc.close()


async def test_consume_hands_over_each_message_in_order_and_unsubscribes_when_cancelled(
    nats_server: NatsServer,
) -> None:
    listener = await connect_nats(nats_server.url, name="listener")
    sender = await connect_nats(nats_server.url, name="sender")
    heard: list[bytes] = []
    all_heard = asyncio.Event()

    def handle(message: Msg) -> None:
        heard.append(message.data)
        if len(heard) == 200:
            all_heard.set()

    subscribed = asyncio.Event()
    task = asyncio.create_task(consume(listener, "news", handle, subscribed=subscribed))
    try:
        await asyncio.wait_for(subscribed.wait(), 5)
        await flush(listener)
        for number in range(200):
            await sender.publish("news", str(number).encode())
        await flush(sender)
        await asyncio.wait_for(all_heard.wait(), 5)
        assert heard == [str(number).encode() for number in range(200)]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await flush(listener)
        assert not listener._subs  # private in nats-py 2.16 (pinned): the subscription is gone from the server's view
    finally:
        task.cancel()
        await listener.close()
        await sender.close()


async def test_consume_raises_what_the_handler_raised_and_stops_listening(nats_server: NatsServer) -> None:
    """A handler's failure reaches the task (whose supervisor logs it and subscribes again), not nats-py's
    error callback, where it would be a warning and the listener would go on half broken."""
    listener = await connect_nats(nats_server.url, name="listener")
    sender = await connect_nats(nats_server.url, name="sender")
    heard: list[bytes] = []

    def handle(message: Msg) -> None:
        heard.append(message.data)
        if message.data == b"poison":
            raise ValueError("cannot digest this")

    subscribed = asyncio.Event()
    task = asyncio.create_task(consume(listener, "news", handle, subscribed=subscribed))
    try:
        await asyncio.wait_for(subscribed.wait(), 5)
        await flush(listener)
        for data in (b"first", b"poison", b"after"):
            await sender.publish("news", data)
        await flush(sender)
        with pytest.raises(ValueError, match="cannot digest this"):
            await asyncio.wait_for(task, 5)
        await sender.publish("news", b"later")
        await flush(sender)
        await flush(listener)
        assert heard == [b"first", b"poison"]  # nothing after the failure: the subscription ended with it
        assert not listener._subs
    finally:
        task.cancel()
        await listener.close()
        await sender.close()


async def test_closing_on_a_server_that_stopped_answering_takes_the_flush_limit_not_nats_pys_drain(
    nats_server: NatsServer,
) -> None:
    # A whole stack stopped at once: the server goes while this process closes. nats-py's drain waited 10 s per
    # flush for it, and a live-update bridge outlived its killed `flotilla up` by over 20 s (CI caught it).
    nc = await connect_nats(nats_server.url, name="closing")
    await nc.subscribe("anything")
    await nc.publish("anything", b"sent before the server froze")
    os.kill(nats_server.process.pid, signal.SIGSTOP)  # the socket stays open; nothing answers on it
    try:
        async with asyncio.timeout(5):  # nats-py's drain would still be waiting here
            await close_nats(nc, within=0.3)
        assert nc.is_closed
        await close_nats(nc)  # closing a closed connection is a no-op, not an error
    finally:
        os.kill(nats_server.process.pid, signal.SIGCONT)
