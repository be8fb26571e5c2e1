"""The request log and the metric samples (controlplane/traffic/): gateways' records on a real NATS stored as rows
with their pipeline and instance, the samples of a window written from them and the workers' loads, percentiles
on a known set, and pruning past the retention."""

import asyncio
import datetime
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from channels.db import database_sync_to_async
from nats.aio.client import Client as NATS

from controlplane.deployments.models import Instance
from controlplane.fleet.models import Node
from controlplane.live.bridge import InstanceDirectory, read_directory
from controlplane.traffic.models import MetricSample, RequestRecord
from controlplane.traffic.recorder import Retention, TrafficRecorder, prune, sample_window_s
from controlplane.traffic.sampling import percentile
from runtime.cluster.nats_connection import connect_nats, flush
from runtime.fleet_contract import request_records as contract
from runtime.supervision import Supervisor
from tests.controlplane.live_fixtures import TwoPipelines, two_placed_pipelines
from tests.infra import NatsServer

ENDPOINT_A = 0x1A


@dataclass
class Running:
    recorder: TrafficRecorder
    gateway: NATS  # a gateway's connection, to publish on
    loads: list[tuple[int, dict[str, float]]]  # the workers' latest loads, as the bridge would give them


@pytest.fixture
async def running(nats_server: NatsServer) -> AsyncIterator[Running]:
    bridge_nc = await connect_nats(nats_server.url, name="bridge")
    gateway = await connect_nats(nats_server.url, name="gateway")
    supervisor = Supervisor(on_fatal=lambda: None)
    loads: list[tuple[int, dict[str, float]]] = []
    recorder = TrafficRecorder(
        bridge_nc,
        InstanceDirectory(database_sync_to_async(read_directory)),
        supervisor,
        loads=lambda: loads,
        flush_s=3600,  # the test flushes and samples itself
    )
    recorder.start()
    await flush(bridge_nc)
    yield Running(recorder, gateway, loads)
    await supervisor.close()
    await bridge_nc.close()
    await gateway.close()


def placed() -> TwoPipelines:
    rows = two_placed_pipelines()
    Instance.objects.filter(pk=rows.a_instance.pk).update(endpoint_instance_id=ENDPOINT_A)
    return rows


def record(request_id: str, **fields: object) -> contract.RequestRecord:
    defaults: dict[str, object] = {"at": time.time(), "endpoint": "chat", "status": 200, "model": "alpha"}
    return contract.RequestRecord(request_id=request_id, **{**defaults, **fields})  # type: ignore[arg-type]


async def publish(running: Running, *records: contract.RequestRecord) -> None:
    running.recorder.received_event.clear()
    batch = contract.RecordBatch(gateway="test:1", records=list(records))
    await running.gateway.publish(contract.REQUEST_RECORDS_SUBJECT, contract.encode_batch(batch))
    await flush(running.gateway)
    async with asyncio.timeout(10):
        await running.recorder.received_event.wait()


@pytest.mark.django_db(transaction=True)
async def test_records_are_stored_with_their_pipeline_instance_and_the_routers_decision(running: Running) -> None:
    rows = await database_sync_to_async(placed)()
    route = contract.RouteChoice(
        mode="kv", instance_id=ENDPOINT_A, dp_rank=0, overlap_blocks=6, prompt_blocks=8, cost=2.5, candidates=2
    )
    await publish(
        running,
        record("routed", route=route, prompt_tokens=130, cached_tokens=96, completion_tokens=4, ttft_s=0.05),
        record("refused", model="beta", status=429, error="rate_limit_error", api_key_id=7),
    )
    await running.recorder.flush()

    routed = await RequestRecord.objects.aget(request_id="routed")
    assert (routed.pipeline_id, routed.instance_id) == (rows.a.pk, rows.a_instance.pk)
    assert (routed.router_mode, routed.overlap_blocks, routed.prompt_blocks, routed.cost) == ("kv", 6, 8, 2.5)
    refused = await RequestRecord.objects.aget(request_id="refused")
    # No worker: the pipeline is the one serving its model's name.
    assert (refused.pipeline_id, refused.instance_id, refused.status, refused.api_key_id) == (rows.b.pk, None, 429, 7)


@pytest.mark.django_db(transaction=True)
async def test_a_batch_out_of_bounds_is_refused_whole_and_the_next_is_stored(running: Running) -> None:
    await running.gateway.publish(contract.REQUEST_RECORDS_SUBJECT, b'{"gateway": "x", "records": [{"at": -1}]}')
    await publish(running, record("good"))
    await running.recorder.flush()
    assert running.recorder.refused_batches == 1
    assert [row.request_id async for row in RequestRecord.objects.all()] == ["good"]


@pytest.mark.django_db(transaction=True)
async def test_a_window_s_samples_are_written_fleet_wide_per_pipeline_and_per_node(running: Running) -> None:
    rows = await database_sync_to_async(placed)()
    running.loads.append((rows.a.pk, {"waiting": 3, "kv_usage": 0.5}))
    route = contract.RouteChoice(mode="kv", instance_id=ENDPOINT_A)
    ttfts = [0.1, 0.2, 0.3, 0.4]
    await publish(
        running,
        *[
            record(f"ok-{n}", route=route, ttft_s=ttft, prompt_tokens=100, cached_tokens=50)
            for n, ttft in enumerate(ttfts)
        ],
        record("failed", model="beta", status=503, error="service_unavailable"),
    )
    await running.recorder.flush()
    await Node.objects.filter(name="gpu-a").aupdate(cpu_utilization_percent=37.5)  # as its last heartbeat said
    assert await running.recorder.sample() == 4  # the fleet, alpha, beta, node gpu-a

    fleet = await MetricSample.objects.aget(scope=MetricSample.Scope.FLEET)
    assert (fleet.requests, fleet.error_rate) == (5, 1 / 5)
    assert fleet.ttft_p50_s == pytest.approx(0.25)
    assert fleet.prefix_hit_rate == pytest.approx(0.5)
    alpha = await MetricSample.objects.aget(scope=MetricSample.Scope.PIPELINE, pipeline=rows.a)
    assert (alpha.requests, alpha.error_rate, alpha.queue_depth, alpha.kv_usage) == (4, 0.0, 3.0, 0.5)
    beta = await MetricSample.objects.aget(scope=MetricSample.Scope.PIPELINE, pipeline=rows.b)
    assert (beta.requests, beta.error_rate, beta.ttft_p50_s, beta.queue_depth) == (1, 1.0, None, None)
    node = await MetricSample.objects.select_related("node").aget(scope=MetricSample.Scope.NODE)
    assert node.node.name == "gpu-a" and node.memory_total_bytes is not None
    assert node.cpu_utilization_percent == 37.5


def test_percentiles_of_a_known_set_interpolate_between_ranks() -> None:
    values = [float(n) for n in range(1, 101)]  # 1..100, shuffled order does not matter
    assert percentile(values[::-1], 50) == pytest.approx(50.5)
    assert percentile(values, 95) == pytest.approx(95.05)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) is None


@pytest.mark.django_db
def test_rows_past_their_retention_are_pruned_and_younger_ones_kept() -> None:
    now = datetime.datetime(2026, 1, 2, 12, 0, tzinfo=datetime.UTC)
    for age_h in (1, 25):
        at = now - datetime.timedelta(hours=age_h)
        RequestRecord.objects.create(at=at, request_id=f"{age_h}h", endpoint="chat", status=200)
        MetricSample.objects.create(at=at, window_s=10, scope=MetricSample.Scope.FLEET)
    assert prune(now, Retention(requests_s=86_400, samples_s=2 * 86_400)) == (1, 0)
    assert list(RequestRecord.objects.values_list("request_id", flat=True)) == ["1h"]
    assert MetricSample.objects.count() == 2


def test_the_sample_window_is_10_s_unless_the_environment_shortens_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLOTILLA_METRICS_SAMPLE_S", raising=False)
    assert sample_window_s() == 10.0
    monkeypatch.setenv("FLOTILLA_METRICS_SAMPLE_S", "1")
    assert sample_window_s() == 1.0
