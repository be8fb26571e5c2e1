"""The SGLang KV event subscriber on a real ZMQ socket, fed as SGLang's ZmqEventPublisher sends (topic,
8-byte big-endian sequence number, msgpack batch). pyzmq comes with SGLang and vLLM; the dev extra installs
it for this test."""

import asyncio
import threading
from typing import Any

import msgspec
import zmq

from engines.shared.zmq_kv_events import ZmqSubscriber, free_tcp_ports


async def test_the_subscriber_hands_each_published_batch_to_its_callback_decoded() -> None:
    port = free_tcp_ports(1)
    publisher = zmq.Context.instance().socket(zmq.PUB)
    publisher.bind(f"tcp://*:{port}")  # as SGLang binds a wildcard endpoint
    received: list[Any] = []
    arrived = threading.Event()

    def on_batch(batch: Any) -> None:
        received.append(batch)
        arrived.set()

    batch = [1.5, [["BlockStored", [1], None, list(range(16)), 16, None], ["AllBlocksCleared"]]]
    subscriber = ZmqSubscriber(f"tcp://*:{port}", "flotilla-kv", on_batch)
    try:
        # A SUB socket hears only what is sent after it joined: publish until the first batch arrives.
        sequence = 0
        while not arrived.is_set():
            frames = [b"flotilla-kv", sequence.to_bytes(8, "big"), msgspec.msgpack.encode(batch)]
            publisher.send_multipart(frames)
            sequence += 1
            await asyncio.to_thread(arrived.wait, 0.05)
    finally:
        subscriber.close()
        publisher.close(linger=0)
    assert received[0] == batch
