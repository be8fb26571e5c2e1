"""A LoRA adapter's pool's KV router on a real NATS: it indexes only its adapter's blocks (``lora_id``), names
its requests' blocks from the adapter's root hash, and the base model's router never counts adapter blocks."""

from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client as NATS

from frontend_gateway.routing import kv_subscriber
from frontend_gateway.routing.kv_indexer import KvIndexer
from frontend_gateway.routing.kv_router import KvRouter
from frontend_gateway.routing.kv_subscriber import routable
from frontend_gateway.routing.protocol import InstanceInfo, RouterMode, RouterSettings
from runtime.cluster.addressing import EndpointAddress
from runtime.cluster.nats_connection import connect_nats, flush
from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import BlockRemoved, BlockStored, KvEvent, KvEventBatch
from runtime.lora import lora_id, lora_root_hash
from runtime.protocol import PreprocessedRequest, SamplingOptions, StopConditions
from tests.frontend_gateway.routing.waiting import QUICK_STATE_RETRIES, until
from tests.infra import NatsServer

BLOCK = 16
ADDRESS = EndpointAddress("llm", "backend", "generate")
A, B = InstanceInfo(0xA, "s.a"), InstanceInfo(0xB, "s.b")
PROMPT = list(range(1000, 1000 + 6 * BLOCK + 3))
ADAPTER = lora_id("sql-expert")
BASE_HASHES = sequence_block_hashes(PROMPT, BLOCK)
ADAPTER_HASHES = sequence_block_hashes(PROMPT, BLOCK, lora_root_hash(ADAPTER))
KV = RouterSettings(mode=RouterMode.KV, seed=1)


@pytest.fixture(autouse=True)
def _quick_state_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_subscriber, "STATE_RETRY_DELAYS_S", QUICK_STATE_RETRIES)


@pytest.fixture
async def connections(nats_server: NatsServer) -> AsyncIterator[tuple[NATS, NATS]]:
    router_side = await connect_nats(nats_server.url, name="lora-router-test")
    worker_side = await connect_nats(nats_server.url, name="lora-router-test-workers")
    yield router_side, worker_side
    await worker_side.close()
    await router_side.close()


@pytest.fixture
async def make_router(connections: tuple[NATS, NATS]) -> AsyncIterator[Callable[..., Any]]:
    routers: list[KvRouter] = []

    async def make(lora: int | None) -> KvRouter:
        router = KvRouter(KV, block_size=BLOCK, nc=connections[0], address=ADDRESS, lora_id=lora)
        routers.append(router)
        await router.start()
        for instance in (A, B):
            router.instance_added(instance)
        return router

    yield make
    for router in routers:
        await router.close()


async def publish(nc: NATS, instance: InstanceInfo, event_id: int, *events: KvEvent) -> None:
    batch = KvEventBatch(instance_id=instance.instance_id, event_id=event_id, events=list(events))
    await nc.publish(ADDRESS.kv_events_subject(), msgspec.msgpack.encode(batch))
    await flush(nc)


def blocks_of(router: KvRouter, instance: InstanceInfo) -> int:
    assert isinstance(router.indexer, KvIndexer)
    return router.indexer.block_count((instance.instance_id, 0))


def request(lora: str | None = None) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id="r", model="m", token_ids=PROMPT, sampling=SamplingOptions(),
        stop_conditions=StopConditions(max_tokens=8), lora_name=lora,
    )  # fmt: skip


def test_routable_keeps_a_pools_own_blocks_only() -> None:
    base = BlockStored(BASE_HASHES[:2])
    adapted = BlockStored(ADAPTER_HASHES[:2], lora_id=ADAPTER)
    other = BlockStored([7, 8], lora_id=lora_id("another"))
    removed = BlockRemoved([1])
    events: list[KvEvent] = [base, adapted, other, removed]
    assert routable(events) == [base, removed]
    assert routable(events, ADAPTER) == [adapted, removed]
    assert routable([base, removed]) == [base, removed]


async def test_an_adapter_request_goes_to_the_worker_holding_that_adapters_blocks(
    make_router: Any, connections: tuple[NATS, NATS]
) -> None:
    base_router, adapter_router = await make_router(None), await make_router(ADAPTER)
    worker = connections[1]
    # A holds the prompt under the base model, B under the adapter: the same tokens, other blocks.
    await publish(worker, A, 1, BlockStored(BASE_HASHES))
    await publish(worker, B, 1, BlockStored(ADAPTER_HASHES, lora_id=ADAPTER))
    await until(adapter_router, lambda: blocks_of(adapter_router, B) == 6)
    await until(base_router, lambda: blocks_of(base_router, A) == 6)
    # Each pool took its own blocks only.
    assert blocks_of(adapter_router, A) == 0
    assert blocks_of(base_router, B) == 0
    adapter_choice = adapter_router.choose(request("sql-expert"), [A, B])
    assert adapter_choice is not None and (adapter_choice.instance, adapter_choice.overlap_blocks) == (B, 6)
    base_choice = base_router.choose(request(), [A, B])
    assert base_choice is not None and (base_choice.instance, base_choice.overlap_blocks) == (A, 6)
