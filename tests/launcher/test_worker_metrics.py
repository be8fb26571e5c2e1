"""A worker's own /metrics (``--metrics-port``): what it counts, read over HTTP from the small metrics
server, on a real NATS. The whole worker process is in tests/distributed/test_worker_metrics.py."""

import asyncio
import socket
from collections.abc import AsyncIterator

import httpx
import msgspec
import pytest
from nats.aio.client import Client as NATS
from prometheus_client.parser import text_string_to_metric_families

from launcher.metrics_server import serve_metrics
from launcher.worker_metrics import WorkerMetrics
from runtime.cluster.addressing import EndpointAddress
from runtime.cluster.nats_connection import connect_nats
from runtime.errors import ConfigError
from runtime.kv.events import BlockStored, KvEventSink, WorkerLoad
from runtime.kv.publisher import KvEventPublisher
from runtime.request_plane import RequestClient
from tests.infra import NatsServer
from tests.runtime.test_request_plane_abandoned import SUBJECT, Engine, serve
from tests.servers import free_port

ADDRESS = EndpointAddress("llm", "backend", "generate")


class Cache:
    """A KvEventSource with nothing cached: the publisher asks it only for state answers."""

    def attach_kv_events(self, sink: KvEventSink) -> None:
        return None

    def load(self) -> list[WorkerLoad]:
        return []

    def cache_state(self, dp_rank: int | None) -> dict[int, list[BlockStored]]:
        return {}


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[NATS]:
    connection = await connect_nats(nats_server.url, name="worker")
    yield connection
    await connection.close()


async def scrape(metrics: WorkerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics from a metrics server on ``metrics``: every sample, by name and labels."""
    port = free_port()
    server = await serve_metrics("127.0.0.1", port, metrics.exposition)
    try:
        async with httpx.AsyncClient() as client:
            reply = await client.get(f"http://127.0.0.1:{port}/metrics")
    finally:
        server.close()
        await server.wait_closed()
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(reply.text)
        for sample in family.samples
    }


async def test_the_engines_queues_kv_usage_and_preemptions_are_served_per_dp_rank(nc: NATS) -> None:
    server = await serve(nc, Engine())
    reports = [
        WorkerLoad(instance_id=1, dp_rank=0, active_requests=5, running=3, waiting=2, kv_usage=0.5, preemptions=4),
        WorkerLoad(instance_id=1, dp_rank=1, active_requests=1, running=1, waiting=0, kv_usage=0.25, preemptions=0),
    ]
    try:
        samples = await scrape(WorkerMetrics(server=server, load=lambda: reports))
    finally:
        await server.close()
    assert samples[("flotilla_worker_running_requests", (("dp_rank", "0"),))] == 3
    assert samples[("flotilla_worker_waiting_requests", (("dp_rank", "0"),))] == 2
    assert samples[("flotilla_worker_kv_usage_ratio", (("dp_rank", "1"),))] == 0.25
    assert samples[("flotilla_worker_preemptions_total", (("dp_rank", "0"),))] == 4
    # What the engine does not report is left out, not shown as 0.
    assert ("flotilla_worker_kv_total_blocks", (("dp_rank", "0"),)) not in samples
    assert samples[("flotilla_worker_ack_deadline_expiries_total", ())] == 0


class EngineWithMetrics:
    """An engine that keeps Prometheus metrics of its own, in a registry, as vLLM does."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Gauge

        self.registry = CollectorRegistry()
        Gauge("engine:num_requests_running", "Requests running.", registry=self.registry).set(7)

    def prometheus_registry(self) -> object:
        return self.registry


async def test_the_engines_own_metrics_follow_the_workers(nc: NATS) -> None:
    server = await serve(nc, Engine())
    try:
        samples = await scrape(WorkerMetrics(server=server, load=lambda: [], engine=EngineWithMetrics()))
    finally:
        await server.close()
    assert samples[("engine:num_requests_running", ())] == 7
    assert samples[("flotilla_worker_ack_deadline_expiries_total", ())] == 0


async def test_kv_event_batches_nats_would_not_take_are_counted_as_lost(nats_server: NatsServer, nc: NATS) -> None:
    server = await serve(nc, Engine())
    doomed = await connect_nats(nats_server.url, name="publisher")
    publisher = KvEventPublisher(doomed, ADDRESS, 1, Cache())
    publisher.publish(0, [BlockStored([1, 2])])
    await publisher.flush()
    publisher.publish(0, [BlockStored([3], parent_hash=2)])
    await doomed.close()
    await publisher.flush()  # the connection is closed: the batch is lost, and counted
    try:
        samples = await scrape(WorkerMetrics(server=server, load=lambda: [], publisher=publisher))
    finally:
        await server.close()
    assert samples[("flotilla_worker_kv_event_batches_published_total", ())] == 1
    assert samples[("flotilla_worker_kv_event_batches_lost_total", ())] == 1


async def test_a_stream_stopped_at_its_ack_deadline_is_counted(nats_server: NatsServer, nc: NATS) -> None:
    engine = Engine()
    server = await serve(nc, engine, ack_deadline=0.5)
    doomed = await connect_nats(nats_server.url, name="doomed ingress")
    client = RequestClient(doomed, window=4, silence_timeout=60)
    await client.start()
    stream = client.call(SUBJECT, "z", msgspec.msgpack.encode(100_000))
    await anext(stream)
    await doomed.close()  # as if the ingress were killed: no Stop, no more acks
    try:
        async with asyncio.timeout(15):
            await engine.event("z").wait()
        samples = await scrape(WorkerMetrics(server=server, load=lambda: []))
    finally:
        await server.close()
    assert samples[("flotilla_worker_ack_deadline_expiries_total", ())] == 1


async def test_the_metrics_server_answers_only_get_metrics() -> None:
    port = free_port()
    server = await serve_metrics("127.0.0.1", port, lambda: b"# nothing\n")
    try:
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"http://127.0.0.1:{port}/")).status_code == 404
            assert (await client.post(f"http://127.0.0.1:{port}/metrics")).status_code == 405
            assert (await client.get(f"http://127.0.0.1:{port}/metrics")).text == "# nothing\n"
    finally:
        server.close()
        await server.wait_closed()


async def test_a_metrics_port_already_taken_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot serve metrics on 127.0.0.1:{port}.*--metrics-port"):
            await serve_metrics("127.0.0.1", port, lambda: b"")
