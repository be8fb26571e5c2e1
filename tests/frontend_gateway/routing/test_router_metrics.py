"""The router's health in the gateway's /metrics: the KV event subscriber's repairs and the KV router's
choices, per model, on a real NATS (and etcd, for the pools the model watcher builds)."""

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from prometheus_client.parser import text_string_to_metric_families

from frontend_gateway.http_app import GatewayApp
from frontend_gateway.metrics import GatewayMetrics
from frontend_gateway.models.pipeline import ModelRegistry
from frontend_gateway.models.remote_engines import RemoteTextEngine, RemoteTokenEngine
from frontend_gateway.models.watcher import ModelWatcher
from frontend_gateway.routing import kv_subscriber
from frontend_gateway.routing.kv_router import KvRouter
from frontend_gateway.routing.protocol import InstanceInfo, RouterMode, RouterSettings
from runtime.cluster.addressing import EndpointAddress
from runtime.cluster.discovery import MODELS_PREFIX
from runtime.cluster.nats_connection import connect_nats, flush
from runtime.distributed import DistributedRuntime
from runtime.endpoint import ModelEntry
from runtime.kv.blocks import sequence_block_hashes
from runtime.kv.events import BlockStored, KvEventBatch
from runtime.models.card import ModelCard, ModelType
from runtime.protocol import PreprocessedRequest, SamplingOptions, StopConditions
from tests.frontend_gateway.asgi import Client
from tests.frontend_gateway.routing.waiting import QUICK_STATE_RETRIES, until
from tests.infra import EtcdServer, NatsServer

ADDRESS = EndpointAddress("llm", "backend", "generate")
BLOCK = 16
PROMPT = list(range(1000, 1000 + 8 * BLOCK + 5))  # 8 full blocks and 5 tokens
HASHES = sequence_block_hashes(PROMPT, BLOCK)


@pytest.fixture(autouse=True)
def _quick_state_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_subscriber, "STATE_RETRY_DELAYS_S", QUICK_STATE_RETRIES)


@pytest.fixture
async def runtime(etcd_server: EtcdServer, nats_server: NatsServer) -> AsyncIterator[DistributedRuntime]:
    connected = await DistributedRuntime.connect(nats_url=nats_server.url, etcd_endpoints=[etcd_server.endpoint])
    yield connected
    await connected.close()


@pytest.fixture
async def workers(nats_server: NatsServer) -> AsyncIterator[NATS]:
    """The workers' side: a connection of its own, as a worker process would have."""
    connection = await connect_nats(nats_server.url, name="router-metrics-test-workers")
    yield connection
    await connection.close()


async def scrape(metrics: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics from a gateway app on ``metrics``: every sample, by name and labels."""
    client = Client(b"")
    scope = {"type": "http", "method": "GET", "path": "/metrics", "headers": []}
    await GatewayApp(ModelRegistry(), metrics=metrics)(scope, client.receive, client.send)
    assert client.status == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(client.content.decode())
        for sample in family.samples
    }


def sample(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def publish(nc: NATS, instance_id: int, event_id: int, *events: Any) -> None:
    batch = KvEventBatch(instance_id=instance_id, event_id=event_id, events=list(events))
    await nc.publish(ADDRESS.kv_events_subject(), msgspec.msgpack.encode(batch))
    await flush(nc)


async def test_gaps_stale_batches_state_syncs_and_malformed_events_are_counted_per_model_in_metrics(
    runtime: DistributedRuntime, workers: NATS
) -> None:
    async def answer_state(message: Msg) -> None:
        state = KvEventBatch(instance_id=1, event_id=0, events=[BlockStored(HASHES[:2])])
        await message.respond(msgspec.msgpack.encode(state))

    await workers.subscribe(ADDRESS.kv_state_subject(1), cb=answer_state)
    await flush(workers)
    metrics = GatewayMetrics()
    registry = ModelRegistry()
    watcher = ModelWatcher(runtime, registry, router=RouterSettings(mode=RouterMode.KV), metrics=metrics)
    watch = asyncio.create_task(watcher.run())
    try:
        card = ModelCard(name="m", model_type=ModelType.CHAT, context_length=256, kv_cache_block_size=BLOCK)
        entry = ModelEntry(instance_id=1, subject="s.1", card=card)
        await runtime.discovery.register(f"{MODELS_PREFIX}llm/backend/generate/1", msgspec.json.encode(entry))
        async with asyncio.timeout(30):
            while (model := registry.get("m")) is None:
                watcher.changed.clear()
                await watcher.changed.wait()
        assert isinstance(model.engine, RemoteTextEngine | RemoteTokenEngine)
        router = model.engine.router
        assert isinstance(router, KvRouter)
        await until(router, lambda: router.state_syncs == 1)  # joining: asked for its whole cache
        await publish(workers, 1, 1, BlockStored(HASHES[2:4], parent_hash=HASHES[1]))
        await publish(workers, 1, 3, BlockStored([7]))  # batch 2 was lost: a gap, and a second sync
        await until(router, lambda: router.state_syncs == 2)
        await publish(workers, 1, 5, BlockStored(HASHES[2:3], parent_hash=HASHES[1]))
        await publish(workers, 1, 5, BlockStored(HASHES[2:3], parent_hash=HASHES[1]))  # a duplicate
        await workers.publish(ADDRESS.kv_events_subject(), b"\xc1 not msgpack")
        await flush(workers)
        await until(router, lambda: router.stale_batches == 1 and router.subscriber.malformed == 1)

        samples = await scrape(metrics)
        assert sample(samples, "flotilla_router_kv_event_gaps_total", model="m") == 1
        assert sample(samples, "flotilla_router_kv_state_syncs_total", model="m") == 2
        assert sample(samples, "flotilla_router_kv_stale_batches_total", model="m") == 1
        assert sample(samples, "flotilla_router_kv_malformed_messages_total", model="m") == 1
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await watcher.close()


async def test_the_chosen_workers_overlap_and_the_spread_of_costs_are_observed(
    nats_server: NatsServer, workers: NATS
) -> None:
    nc = await connect_nats(nats_server.url, name="router-metrics-test")
    metrics = GatewayMetrics()
    router = KvRouter(
        RouterSettings(mode=RouterMode.KV, seed=1),
        block_size=BLOCK,
        nc=nc,
        address=ADDRESS,
        health=metrics.for_routing("m"),
    )
    a, b = InstanceInfo(0xA, "s.a"), InstanceInfo(0xB, "s.b")
    try:
        await router.start()
        router.instance_added(a)
        router.instance_added(b)
        await publish(workers, 0xA, 1, BlockStored(HASHES[:6]))
        await until(router, lambda: router.indexer.find_matches(HASHES) == {(0xA, 0): 6})
        request = PreprocessedRequest(
            request_id="r",
            model="m",
            token_ids=PROMPT,
            sampling=SamplingOptions(),
            stop_conditions=StopConditions(max_tokens=8),
        )
        decision = router.choose(request, [a, b])
        assert decision is not None and decision.instance == a
    finally:
        await router.close()
        await nc.close()

    samples = await scrape(metrics)
    assert sample(samples, "flotilla_router_chosen_overlap_blocks_count", model="m") == 1
    assert sample(samples, "flotilla_router_chosen_overlap_blocks_sum", model="m") == 6
    assert sample(samples, "flotilla_router_chosen_overlap_ratio_sum", model="m") == 6 / 8
    # B would compute the 6 blocks A holds (cost weight 1): its cost is 6 blocks higher.
    assert sample(samples, "flotilla_router_cost_spread_blocks_sum", model="m") == 6
    assert sample(samples, "flotilla_router_cost_spread_blocks_bucket", model="m", le="4.0") == 0
    assert sample(samples, "flotilla_router_cost_spread_blocks_bucket", model="m", le="8.0") == 1
