"""SGLang's attention DP across nodes: the KV events of the dp ranks on a rank-1 node reach the leader's worker.

SGLang gives each attention-DP rank a KV cache and an event publisher of its own, on the node the rank runs on: the
scheduler of each rank's first attention-TP rank creates ``ZmqEventPublisher`` on the configured port plus its
attention-DP rank (python/sglang/srt/managers/scheduler.py, ``init_kv_events`` and ``select_kv_publisher_dp_rank``;
python/sglang/srt/disaggregation/kv_events.py, ``ZmqEventPublisher.offset_endpoint_port``), and Dynamo's SGLang
worker subscribes on each node to ``dp_size // nnodes`` of them in node order (components/src/dynamo/sglang,
``DynamoSglangPublisher.init_kv_event_publish``). Here the rank-1 node's publishers are real ZMQ PUB sockets sending
SGLang's frames (``zmq_frames``), its relay (engines/sglang/dp_relay.py) sends them over a real nats-server, and the
leader is an SglangEngine started on the fake SGLang with ``nnodes=2, dp_size=4, enable_dp_attention``, publishing
through a real KvEventPublisher: what routers hear is read on the component's KV event subject.
"""

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from nats.aio.client import Client as NATS

from engines.sglang.dp_relay import DpRelay, relay_subject
from engines.sglang.engine import KV_TOPIC, SglangEngine, rank_endpoints, relayed_dp_ranks, remote_dp_ranks
from engines.sglang.follower import SglangFollower
from engines.shared.gpu_engine_args import GpuPlacement
from engines.shared.node_group import LeaderAddress, NodeGroup
from engines.shared.zmq_kv_events import free_tcp_ports
from runtime.cluster.addressing import EndpointAddress
from runtime.cluster.nats_connection import close_nats, connect_nats, consume, flush
from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import BlockStored, KvEventBatch
from runtime.kv.publisher import KvEventPublisher
from tests.engines.test_sglang import TOKENS, BlockStoredSg, FakeSglang, start_on_fake, zmq_frames
from tests.infra import NatsServer

LEADER = LeaderAddress("10.0.0.1", 29500)
ADDRESS = EndpointAddress("relay-test", "backend", "generate")
DP = {"dp_size": 4, "enable_dp_attention": True}
WAIT_S = 10.0


def stored(tokens: list[int], engine_hash: int) -> BlockStoredSg:
    return BlockStoredSg(
        block_hashes=[engine_hash], parent_block_hash=None, token_ids=tokens, block_size=16, lora_id=None
    )


def test_the_ranks_of_the_other_nodes_are_the_leaders_remote_ranks_and_each_followers_relayed_ones() -> None:
    leader, second = NodeGroup(num_nodes=2, leader=LEADER), NodeGroup(num_nodes=2, node_rank=1, leader=LEADER)
    assert remote_dp_ranks(DP, leader) == range(2, 4)
    assert relayed_dp_ranks(DP, second) == range(2, 4) and relayed_dp_ranks(DP, leader) == range(0)
    # One dp rank spanning both nodes: its first node (the leader's) publishes; nothing is relayed.
    assert remote_dp_ranks({}, leader) == range(0) and relayed_dp_ranks({}, second) == range(0)
    assert remote_dp_ranks(DP, NodeGroup()) == range(0)


def test_a_follower_starts_sglang_with_publishers_for_its_ranks_only_where_it_relays_them() -> None:
    second = NodeGroup(num_nodes=2, node_rank=1, leader=LEADER)
    relaying = SglangFollower(Path("/m"), GpuPlacement(), DP, second, relay_to=ADDRESS, nats_servers=["nats://x:1"])
    config = json.loads(relaying.kwargs["kv_events_config"])
    assert config["topic"] == KV_TOPIC and config["endpoint"].startswith("tcp://*:")
    # Without in=dyn:// there is no pipeline to relay on; with one dp rank the leader's node publishes it.
    assert "kv_events_config" not in SglangFollower(Path("/m"), GpuPlacement(), DP, second).kwargs
    assert "kv_events_config" not in SglangFollower(Path("/m"), GpuPlacement(), {}, second, relay_to=ADDRESS).kwargs


@dataclass
class Leader:
    """The leader's worker: the engine, and the batches its publisher put on the component's KV event subject."""

    engine: SglangEngine
    nc: NATS
    heard: list[KvEventBatch]
    arrived: asyncio.Event


@pytest.fixture
async def leader(monkeypatch: pytest.MonkeyPatch, nats_server: NatsServer) -> AsyncIterator[Leader]:
    engine, _ = await start_on_fake(monkeypatch, FakeSglang([]), DP, NodeGroup(num_nodes=2, leader=LEADER))
    nc = await connect_nats(nats_server.url, name="leader worker")
    publisher = KvEventPublisher(nc, ADDRESS, 0x51, engine)
    engine.attach_kv_events(publisher)
    heard: list[KvEventBatch] = []
    arrived = asyncio.Event()
    decode = msgspec.msgpack.Decoder(KvEventBatch).decode

    def on_batch(message: Any) -> None:
        heard.append(decode(message.data))
        arrived.set()

    router = await connect_nats(nats_server.url, name="router")
    subscribed = asyncio.Event()
    tasks = [
        asyncio.create_task(publisher.publish_forever()),
        asyncio.create_task(consume(router, ADDRESS.kv_events_subject(), on_batch, subscribed=subscribed)),
    ]
    assert engine.relay is not None
    await asyncio.wait_for(asyncio.gather(subscribed.wait(), engine.relay.subscribed.wait()), WAIT_S)
    await flush(router)
    await flush(nc)
    yield Leader(engine, nc, heard, arrived)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await engine.close()
    await close_nats(router)
    await close_nats(nc)


@pytest.fixture
async def node_publishers() -> AsyncIterator[tuple[dict[int, str], dict[int, Any]]]:
    """The rank-1 node's SGLang publishers of dp ranks 2 and 3, bound as SGLang binds them (base port + rank)."""
    base = free_tcp_ports(4)
    endpoints = rank_endpoints(base, range(2, 4))
    sockets: dict[int, Any] = {}
    for rank, endpoint in endpoints.items():
        sockets[rank] = zmq.Context.instance().socket(zmq.PUB)
        sockets[rank].bind(endpoint)
    yield endpoints, sockets
    for socket in sockets.values():
        socket.close(linger=0)


async def publish_until_heard(leader: Leader, send: Callable[[], None], heard: Callable[[], bool]) -> None:
    """Send until ``heard()``: a ZMQ subscriber hears only what is published after it joined, and a NATS
    subscription made again after a restart only what is published after it."""
    async with asyncio.timeout(WAIT_S):
        while not heard():
            leader.arrived.clear()
            send()
            with contextlib.suppress(TimeoutError):  # not yet: send again
                await asyncio.wait_for(leader.arrived.wait(), 0.05)


def rank_heard(leader: Leader, rank: int) -> Callable[[], bool]:
    return lambda: any(batch.dp_rank == rank for batch in leader.heard)


async def test_the_events_of_the_ranks_on_another_node_reach_routers_as_the_leaders_own(
    leader: Leader, node_publishers: tuple[dict[int, str], dict[int, Any]], nats_server: NatsServer
) -> None:
    endpoints, sockets = node_publishers
    relay = DpRelay([nats_server.url], ADDRESS, LEADER, endpoints, KV_TOPIC)
    relay.start()
    try:
        assert await asyncio.to_thread(relay.relaying.wait, WAIT_S)
        first, second = TOKENS[:16], TOKENS[16:]
        await publish_until_heard(
            leader, lambda: sockets[2].send_multipart(zmq_frames(stored(first, 7))), rank_heard(leader, 2)
        )
        await publish_until_heard(
            leader, lambda: sockets[3].send_multipart(zmq_frames(stored(second, 8))), rank_heard(leader, 3)
        )
    finally:
        relay.close()
    # Named as routers name the tokens, per rank, and kept for a router that asks for a rank's cache.
    for rank, tokens in ((2, first), (3, second)):
        named = BlockStored(block_hashes=sequence_block_hashes(tokens, 16))
        events = [event for batch in leader.heard if batch.dp_rank == rank for event in batch.events]
        assert events and all(event == named for event in events)  # sent until heard: maybe more than once
        assert leader.engine.cache_state(rank) == {rank: [named]}
    assert leader.engine.cache_state(0) == {0: []} and relay.relayed >= 2


async def test_a_relayed_rank_of_the_leaders_own_node_or_of_no_node_is_refused(
    leader: Leader, nats_server: NatsServer
) -> None:
    forger = await connect_nats(nats_server.url, name="forger")
    try:
        for rank in (0, 9, "x"):
            await forger.publish(relay_subject(ADDRESS, LEADER, rank), zmq_frames(stored(TOKENS[:16], 7))[2])
        await forger.publish(relay_subject(ADDRESS, LEADER, 3), b"\xc1")  # not msgpack
        # The same sender, after them: once it is heard, they were handled (one subscription keeps their order).
        await forger.publish(relay_subject(ADDRESS, LEADER, 3), zmq_frames(stored(TOKENS[16:], 8))[2])
        await asyncio.wait_for(leader.arrived.wait(), WAIT_S)
    finally:
        await close_nats(forger)
    assert leader.engine.relay is not None and leader.engine.relay.refused == 4
    assert [batch.dp_rank for batch in leader.heard] == [3]
    assert leader.engine.cache_state(0) == {0: []}


async def test_the_relay_waits_for_nats_and_relays_again_after_a_restart(
    leader: Leader, node_publishers: tuple[dict[int, str], dict[int, Any]], nats_server: NatsServer
) -> None:
    endpoints, sockets = node_publishers
    await asyncio.to_thread(nats_server.stop)
    relay = DpRelay([nats_server.url], ADDRESS, LEADER, endpoints, KV_TOPIC)
    relay.start()  # NATS is down: it keeps trying, the follower goes on
    try:
        await asyncio.to_thread(nats_server.start)
        assert await asyncio.to_thread(relay.relaying.wait, WAIT_S)
        await publish_until_heard(
            leader, lambda: sockets[2].send_multipart(zmq_frames(stored(TOKENS[:16], 7))), rank_heard(leader, 2)
        )
        await asyncio.to_thread(nats_server.restart)
        leader.heard.clear()
        await publish_until_heard(
            leader, lambda: sockets[3].send_multipart(zmq_frames(stored(TOKENS[16:], 8))), rank_heard(leader, 3)
        )
    finally:
        relay.close()
    assert leader.engine.cache_state(3) == {3: [BlockStored(block_hashes=sequence_block_hashes(TOKENS[16:], 16))]}
