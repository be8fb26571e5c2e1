"""A router's picture of a worker's cache stays right across a state ask, on real NATS: batches heard before
the answer are applied on top of it unless it covers them, an answer larger than a message comes in parts
from a real publisher, and blocks the index cannot use (another tier, a LoRA adapter, a salt) are set aside."""

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from frontend_gateway.routing.kv_indexer import KvIndexer, TieredMatch
from frontend_gateway.routing.kv_router import KvRouter
from frontend_gateway.routing.protocol import InstanceInfo, RouterMode, RouterSettings
from runtime.cluster.addressing import EndpointAddress
from runtime.cluster.nats_connection import connect_nats, flush
from runtime.kv.events import BlockRemoved, BlockStored, KvEvent, KvEventBatch, KvEventSink, Medium, WorkerLoad
from runtime.kv.publisher import KvEventPublisher, state_parts
from tests.frontend_gateway.routing.waiting import until
from tests.infra import NatsServer

ADDRESS = EndpointAddress("llm", "backend", "generate")
A = InstanceInfo(0xA, "s.a")
HASHES = list(range(101, 121))
KV = RouterSettings(mode=RouterMode.KV, seed=1)


@pytest.fixture
async def connections(nats_server: NatsServer) -> AsyncIterator[tuple[NATS, NATS]]:
    """The router's connection and the worker's, as two processes would have."""
    router_side = await connect_nats(nats_server.url, name="router")
    worker_side = await connect_nats(nats_server.url, name="worker")
    yield router_side, worker_side
    await router_side.close()
    await worker_side.close()


@pytest.fixture
async def make_router(connections: tuple[NATS, NATS]) -> AsyncIterator[Callable[[], Any]]:
    routers: list[KvRouter] = []

    async def make() -> KvRouter:
        router = KvRouter(KV, block_size=16, nc=connections[0], address=ADDRESS)
        routers.append(router)
        await router.start()
        return router

    yield make
    for router in routers:
        await router.close()


def blocks_of(router: KvRouter, tier: Medium | None = None) -> int:
    assert isinstance(router.indexer, KvIndexer)
    return router.indexer.block_count((A.instance_id, 0), tier)


def encoded(event_id: int, *events: KvEvent, **fields: Any) -> bytes:
    batch = KvEventBatch(instance_id=A.instance_id, event_id=event_id, events=list(events), **fields)
    return msgspec.msgpack.encode(batch)


async def test_a_batch_heard_before_the_state_answer_is_applied_on_top_of_it(
    make_router: Any, connections: tuple[NATS, NATS]
) -> None:
    _, worker = connections

    async def answer(message: Msg) -> None:
        # The worker evicts a block after its snapshot: batch 1 says so, and reaches the router first.
        await worker.publish(ADDRESS.kv_events_subject(), encoded(1, BlockRemoved([HASHES[5]])))
        await flush(worker)
        await asyncio.sleep(0.2)
        await message.respond(encoded(0, BlockStored(HASHES[:6]), covers_event_id=0))

    await worker.subscribe(ADDRESS.kv_state_subject(A.instance_id), cb=answer)
    await flush(worker)
    router = await make_router()
    router.instance_added(A)
    await until(router, lambda: router.state_syncs == 1)
    # Without the hold, the answer wiped the removal and block 6 stayed for good: a phantom.
    assert blocks_of(router) == 5
    # Batch 2 continues from batch 1: no gap, no second ask.
    await worker.publish(ADDRESS.kv_events_subject(), encoded(2, BlockStored(HASHES[5:7], parent_hash=HASHES[4])))
    await flush(worker)
    await until(router, lambda: blocks_of(router) == 7)
    assert (router.gaps, router.state_syncs) == (0, 1)


async def test_a_batch_the_answer_covers_is_not_applied_twice(make_router: Any, connections: tuple[NATS, NATS]) -> None:
    _, worker = connections

    async def answer(message: Msg) -> None:
        # Batch 1 stored blocks 7 and 8 and was removed again in batch 2; the answer covers both.
        await worker.publish(ADDRESS.kv_events_subject(), encoded(1, BlockStored(HASHES[6:8], parent_hash=HASHES[5])))
        await flush(worker)
        await asyncio.sleep(0.2)
        await message.respond(encoded(0, BlockStored(HASHES[:6]), covers_event_id=2))

    await worker.subscribe(ADDRESS.kv_state_subject(A.instance_id), cb=answer)
    await flush(worker)
    router = await make_router()
    router.instance_added(A)
    await until(router, lambda: router.state_syncs == 1)
    assert blocks_of(router) == 6
    assert router.stale_batches == 1


class _Cache:
    """A worker's cache of ``blocks`` chained blocks, as an engine reports it (KvEventSource)."""

    def __init__(self, blocks: list[int]) -> None:
        self.blocks = blocks

    def attach_kv_events(self, sink: KvEventSink) -> None:
        return None

    def load(self) -> list[WorkerLoad]:
        return []

    def cache_state(self, dp_rank: int | None) -> dict[int, list[BlockStored]]:
        return {0: [BlockStored(self.blocks[:7]), BlockStored(self.blocks[7:], parent_hash=self.blocks[6])]}


async def test_a_state_larger_than_a_message_comes_in_parts_and_is_put_together(
    make_router: Any, connections: tuple[NATS, NATS]
) -> None:
    _, worker = connections
    publisher = KvEventPublisher(worker, ADDRESS, A.instance_id, _Cache(HASHES), max_part_hashes=3)
    await publisher.start()
    await flush(worker)
    router = await make_router()
    router.instance_added(A)
    await until(router, lambda: router.state_syncs == 1)
    assert blocks_of(router) == 20  # 7 parts of at most 3 hashes
    assert router.subscriber.malformed == 0


def test_state_parts_keep_the_chain_across_a_cut() -> None:
    events = [BlockStored([1, 2, 3, 4, 5]), BlockStored([9], parent_hash=3)]
    assert state_parts(events, 2) == [
        [BlockStored([1, 2])],
        [BlockStored([3, 4], parent_hash=2)],
        [BlockStored([5], parent_hash=4), BlockStored([9], parent_hash=3)],
    ]
    assert state_parts([], 2) == [[]]  # an empty cache is one (empty) answer


async def test_blocks_of_an_adapter_or_a_salt_are_set_aside_and_lower_tiers_kept_apart(
    make_router: Any, connections: tuple[NATS, NATS]
) -> None:
    _, worker = connections

    async def answer(message: Msg) -> None:
        await message.respond(encoded(0, BlockStored(HASHES[:4]), covers_event_id=0))

    await worker.subscribe(ADDRESS.kv_state_subject(A.instance_id), cb=answer)
    await flush(worker)
    router = await make_router()
    router.instance_added(A)
    await until(router, lambda: router.state_syncs == 1)
    batch = encoded(
        1,
        BlockStored(HASHES[4:6], parent_hash=HASHES[3], medium="cpu"),  # offloaded: indexed on the host tier
        BlockStored(HASHES[6:8], parent_hash=HASHES[3], lora_id=3),  # an adapter's: no request of ours matches
        BlockStored(HASHES[8:10], parent_hash=HASHES[3], salt="tenant-7"),
        BlockRemoved(HASHES[:2], medium="cpu"),  # the CPU copy went, the GPU's stays
        BlockStored(HASHES[10:11], parent_hash=HASHES[3], token_ids=list(range(16)), medium="gpu"),
    )
    await worker.publish(ADDRESS.kv_events_subject(), batch)
    await flush(worker)
    await until(router, lambda: blocks_of(router) == 5)
    assert blocks_of(router, "cpu") == 2  # the host copies of HASHES[:2] never were: their removal removed nothing
    assert router.indexer.find_tiered(HASHES[:6]) == {(A.instance_id, 0): TieredMatch(4, host=2)}  # type: ignore[union-attr]
    # An older worker's events (no trailing fields) still decode.
    old_style = msgspec.msgpack.encode(
        {"instance_id": A.instance_id, "dp_rank": 0, "event_id": 2, "events": [["stored", [HASHES[11]], HASHES[10]]]}
    )
    await worker.publish(ADDRESS.kv_events_subject(), old_style)
    await flush(worker)
    await until(router, lambda: blocks_of(router) == 6)
