"""The request log's records: the gateway publishes one per finished request on NATS, with the router's
decision, and never fails or waits for it (real etcd and NATS, a worker of this process on the request plane)."""

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client as NATS
from prometheus_client.parser import text_string_to_metric_families

from frontend_gateway.http_app import GatewayApp
from frontend_gateway.metrics import GatewayMetrics
from frontend_gateway.models.pipeline import ModelRegistry
from frontend_gateway.models.watcher import ModelWatcher
from frontend_gateway.request_log import RecordPublisher
from frontend_gateway.routing.protocol import RouterMode, RouterSettings
from runtime.cluster.nats_connection import connect_nats, flush
from runtime.distributed import DistributedRuntime
from runtime.endpoint import register_model
from runtime.engine import RequestContext
from runtime.fleet_contract.request_records import (
    REQUEST_RECORDS_SUBJECT,
    RequestRecord,
    decode_batch,
)
from runtime.models.card import ModelCard, ModelType
from runtime.models.loading import load_model_card
from runtime.protocol import EngineOutput
from tests.frontend_gateway.asgi import call
from tests.infra import EtcdServer, NatsServer

BLOCK = 16
PROMPT = list(range(1000, 1000 + 8 * BLOCK + 5))  # 8 full blocks and 5 tokens


@pytest.fixture
async def runtime(etcd_server: EtcdServer, nats_server: NatsServer) -> AsyncIterator[DistributedRuntime]:
    connected = await DistributedRuntime.connect(nats_url=nats_server.url, etcd_endpoints=[etcd_server.endpoint])
    yield connected
    await connected.close()


@pytest.fixture
async def listener(nats_server: NatsServer) -> AsyncIterator[asyncio.Queue[RequestRecord]]:
    """The control plane's side: every record published, in order."""
    nc = await connect_nats(nats_server.url, name="request-log-test")
    records: asyncio.Queue[RequestRecord] = asyncio.Queue()

    async def take(message: object) -> None:
        for record in decode_batch(message.data).records:  # type: ignore[attr-defined]
            records.put_nowait(record)

    await nc.subscribe(REQUEST_RECORDS_SUBJECT, cb=take)
    await flush(nc)
    yield records
    await nc.close()


async def answer_two_tokens(payload: msgspec.Raw, context: RequestContext) -> AsyncIterator[bytes]:
    yield msgspec.msgpack.encode(EngineOutput(token_ids=[42], cached_tokens=0))
    yield msgspec.msgpack.encode(EngineOutput(token_ids=[43], finish_reason="stop"))


async def next_record(records: asyncio.Queue[RequestRecord]) -> RequestRecord:
    async with asyncio.timeout(10):
        return await records.get()


async def test_a_kv_routed_request_s_record_carries_its_worker_overlap_tokens_and_timings(
    runtime: DistributedRuntime,
    nats_server: NatsServer,
    etcd_server: EtcdServer,
    smollm2: Path,
    listener: asyncio.Queue[RequestRecord],
) -> None:
    registry = ModelRegistry()
    # Caches predicted from the router's own decisions: the second request finds the first's blocks.
    settings = RouterSettings(mode=RouterMode.KV, use_kv_events=False)
    watcher = ModelWatcher(runtime, registry, router=settings, metrics=GatewayMetrics())
    watch = asyncio.create_task(watcher.run())
    worker = await DistributedRuntime.connect(nats_url=nats_server.url, etcd_endpoints=[etcd_server.endpoint])
    try:
        endpoint = worker.namespace("test").component("backend").endpoint("generate")
        await endpoint.serve_bytes(answer_two_tokens)
        card: ModelCard = msgspec.structs.replace(load_model_card(smollm2), name="m", kv_cache_block_size=BLOCK)
        await register_model(ModelType.TOKENS, endpoint, card=card)
        async with asyncio.timeout(30):
            while registry.get("m") is None:
                watcher.changed.clear()
                await watcher.changed.wait()
        app = GatewayApp(registry)
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 4}
        assert (await call(app, "/v1/completions", body)).status == 200
        first = await next_record(listener)
        assert (await call(app, "/v1/completions", body)).status == 200
        second = await next_record(listener)
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await watcher.close()
        await worker.close()

    assert first.route is not None and second.route is not None
    assert (first.route.mode, first.route.instance_id, first.route.candidates) == ("kv", worker.instance_id, 1)
    assert (first.route.overlap_blocks, first.route.prompt_blocks) == (0, 8)
    assert (second.route.overlap_blocks, second.route.prompt_blocks) == (8, 8)
    assert second.route.cost is not None and second.route.cost < first.route.cost  # type: ignore[operator]
    assert (second.model, second.endpoint, second.status, second.error) == ("m", "completions", 200, "")
    assert (second.prompt_tokens, second.completion_tokens, second.cached_tokens) == (len(PROMPT), 2, 0)
    assert second.api_key_id is None  # keys are off
    assert second.ttft_s is not None and second.duration_s >= second.ttft_s
    assert first.request_id != second.request_id


async def test_a_refused_request_is_recorded_with_its_status_and_error(
    runtime: DistributedRuntime, listener: asyncio.Queue[RequestRecord]
) -> None:
    registry = ModelRegistry()
    watcher = ModelWatcher(runtime, registry)
    try:
        app = GatewayApp(registry)
        client = await call(
            app, "/v1/chat/completions", {"model": "nowhere", "messages": [{"role": "user", "content": "hi"}]}
        )
        assert client.status == 404
        record = await next_record(listener)
    finally:
        await watcher.close()
    assert (record.model, record.endpoint, record.status) == ("nowhere", "chat", 404)
    assert record.error == "invalid_request_error" and record.route is None
    assert record.completion_tokens == 0 and record.ttft_s is None


async def test_records_are_dropped_and_counted_when_nats_is_down_and_the_request_is_served(
    nats_server: NatsServer,
) -> None:
    nc: NATS = await connect_nats(nats_server.url, name="request-log-down")
    await nc.close()  # NATS lost: publishing is impossible
    metrics = GatewayMetrics()
    publisher = RecordPublisher(nc, on_dropped=metrics.request_records_dropped_count)
    registry = ModelRegistry()
    registry.request_log = publisher
    app = GatewayApp(registry, metrics=metrics)
    client = await call(
        app, "/v1/chat/completions", {"model": "nowhere", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert client.status == 404  # answered as ever
    await publisher.close()  # flushes: nothing can go
    assert (publisher.dropped, publisher.published) == (1, 0)
    text = metrics.exposition().decode()
    samples = {
        (sample.name, tuple(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert samples[("flotilla_frontend_request_records_dropped_total", (("reason", "nats_unavailable"),))] == 1
