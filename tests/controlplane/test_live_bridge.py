"""The bridge (controlplane/live/bridge.py, ``manage.py live_bridge``): workers' load on a real NATS, pushed as
the load partial to the right pipeline's group on the Redis channel layer."""

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

import msgspec
import pytest
from channels.db import database_sync_to_async
from channels.layers import BaseChannelLayer, get_channel_layer
from django.core.management import call_command
from django.core.management.base import CommandError
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from controlplane.deployments import upkeep
from controlplane.deployments.models import Instance, Pipeline
from controlplane.deployments.pipelines import GroupSpec, deploy_pipeline
from controlplane.live.bridge import (
    BridgeError,
    InstanceDirectory,
    InstanceFigures,
    LiveBridge,
    NatsWatch,
    Watched,
    read_directory,
)
from controlplane.live.fleet_load import summarise as summarise_fleet
from controlplane.live.groups import LOAD, pipeline_group
from runtime.cluster.nats_connection import connect_nats, flush
from runtime.kv.events import BlockRemoved, BlockStored, KvEventBatch, TierLoad, WorkerLoad
from runtime.supervision import Supervisor
from tests.controlplane.factories import TEST_ACTOR, make_model, make_node
from tests.controlplane.live_fixtures import TwoPipelines, live_layer, two_placed_pipelines
from tests.infra import NatsServer
from tests.servers import free_port

__all__ = ["live_layer"]  # a fixture
RECEIVE_S = 10.0
ENDPOINT_A, ENDPOINT_B = 0x1A, 0x1B


def give_endpoint_ids() -> TwoPipelines:
    rows = two_placed_pipelines()
    Instance.objects.filter(pk=rows.a_instance.pk).update(endpoint_instance_id=ENDPOINT_A)
    Instance.objects.filter(pk=rows.b_instance.pk).update(endpoint_instance_id=ENDPOINT_B)
    return rows


@dataclass
class Running:
    bridge: LiveBridge
    worker: NATS  # a worker's connection, to publish on
    layer: BaseChannelLayer


@pytest.fixture
async def running_bridge(nats_server: NatsServer, live_layer: object) -> AsyncIterator[Running]:
    layer = get_channel_layer()
    assert layer is not None
    bridge_nc = await connect_nats(nats_server.url, name="bridge", wait=RECEIVE_S)
    worker = await connect_nats(nats_server.url, name="worker", wait=RECEIVE_S)
    supervisor = Supervisor(on_fatal=lambda: None)
    bridge = LiveBridge(bridge_nc, layer, InstanceDirectory(database_sync_to_async(read_directory)), supervisor)
    bridge.start()
    await flush(bridge_nc)  # the subscriptions are in place before a worker publishes
    yield Running(bridge, worker, layer)
    await supervisor.close()
    await bridge.close()
    await bridge_nc.close()
    await worker.close()


async def listen(layer: BaseChannelLayer, pipeline_id: int) -> str:
    channel = await layer.new_channel()
    await layer.group_add(pipeline_group(pipeline_id), channel)
    return channel


async def receive_load(layer: BaseChannelLayer, channel: str) -> dict[str, Any]:
    """The next load push on ``channel``; the control plane's own change notices (of the rows the test
    made, sent after their commit) are skipped."""
    while True:
        message = await asyncio.wait_for(layer.receive(channel), RECEIVE_S)
        if message["type"] == "live.html":
            return message


async def publish_load(worker: NATS, namespace: str, load: WorkerLoad) -> None:
    await worker.publish(f"flotilla.{namespace}.backend.load_metrics", msgspec.json.encode(load))
    await flush(worker)


@dataclass
class SplitPipeline:
    """A disaggregated pipeline: two prefill instances and one decode instance, with their workers' ids."""

    pipeline: Pipeline
    prefill_group: int
    decode_group: int
    prefill_workers: tuple[int, int] = (0x2A, 0x2B)
    decode_worker: int = 0x2C


def split_pipeline() -> SplitPipeline:
    make_node("gpu-a")
    groups = [GroupSpec(role="prefill", replicas=2), GroupSpec(role="decode")]
    pipeline = deploy_pipeline(TEST_ACTOR, name="split", model=make_model("split-model"), groups=groups)
    upkeep.place_pending_instances(TEST_ACTOR)
    split = SplitPipeline(pipeline, *(pipeline.groups.get(role=role).pk for role in ("prefill", "decode")))
    instances = pipeline.instances.order_by("group__role", "replica")  # decode, then prefill 0 and 1
    for instance, worker in zip(instances, (split.decode_worker, *split.prefill_workers), strict=True):
        Instance.objects.filter(pk=instance.pk).update(endpoint_instance_id=worker)
    return split


async def receive_phases(layer: BaseChannelLayer, channel: str, group: int, showing: str) -> str:
    """The HTML of the next push of ``group``'s phases that shows ``showing`` (earlier ones are skipped)."""
    while True:
        message = await receive_load(layer, channel)
        if message.get("group") == group and showing in message["html"]:
            return str(message["html"])


@pytest.mark.django_db(transaction=True)
async def test_a_worker_load_on_nats_reaches_its_pipelines_group_as_the_load_partial(running_bridge: Running) -> None:
    rows = await database_sync_to_async(give_endpoint_ids)()
    layer = running_bridge.layer
    on_a, on_b = await listen(layer, rows.a.pk), await listen(layer, rows.b.pk)
    # The subscription task may still be subscribing: a worker publishes every second anyway.
    await _until_bridge_subscribed(running_bridge)

    load = WorkerLoad(instance_id=ENDPOINT_A, active_requests=3, running=2, waiting=1, kv_usage=0.37)
    await publish_load(running_bridge.worker, rows.a.namespace, load)
    pushed = await receive_load(layer, on_a)
    assert pushed["type"] == "live.html"
    assert pushed["instance"] == rows.a_instance.pk
    assert f'id="load-{rows.a_instance.pk}"' in pushed["html"]
    assert 'data-kv-usage="0.37"' in pushed["html"]

    # B's group hears B's load first: A's went to A's group only.
    await publish_load(running_bridge.worker, rows.b.namespace, WorkerLoad(instance_id=ENDPOINT_B, active_requests=9))
    first_on_b = await receive_load(layer, on_b)
    assert first_on_b["instance"] == rows.b_instance.pk


@pytest.mark.django_db(transaction=True)
async def test_workers_loads_reach_the_overview_as_each_pipelines_kv_figures(running_bridge: Running) -> None:
    rows = await database_sync_to_async(give_endpoint_ids)()
    layer = running_bridge.layer
    overview = await layer.new_channel()
    await layer.group_add(LOAD, overview)
    await _until_bridge_subscribed(running_bridge)

    await publish_load(
        running_bridge.worker, rows.a.namespace, WorkerLoad(instance_id=ENDPOINT_A, active_requests=1, kv_usage=0.37)
    )
    # llama.cpp's workers report requests only: the overview says the engine reports no KV figures.
    await publish_load(running_bridge.worker, rows.b.namespace, WorkerLoad(instance_id=ENDPOINT_B, active_requests=2))
    while True:
        pushed = await receive_load(layer, overview)
        if "beta" in pushed["html"] and "alpha" in pushed["html"]:
            break
    assert 'id="fleet-kv"' in pushed["html"]
    alpha, beta = (
        re.search(rf'data-pipeline="{pk}">(.*?)</div>\s*</div>', pushed["html"], re.S) for pk in (rows.a.pk, rows.b.pk)
    )
    assert alpha and "<strong>37%</strong>" in alpha.group(0)
    assert beta and "the engine reports none" in beta.group(0) and "2 active" in beta.group(0)


def test_the_overviews_figures_are_means_of_the_kv_use_and_sums_of_the_requests() -> None:
    loads = [
        (1, {"kv_usage": 0.2, "prefix_hit_rate": 0.5, "running": 2, "waiting": 1, "tokens_per_s": 100.0}),
        (1, {"kv_usage": 0.4, "running": 3, "waiting": 0, "tokens_per_s": 50.0}),
        (2, {"active_requests": 4, "kv_usage": float("nan")}),
    ]
    summary = summarise_fleet(loads)
    assert summary[1] == pytest.approx(
        {"instances": 2, "kv_usage": 0.3, "prefix_hit_rate": 0.5, "running": 5, "waiting": 1, "tokens_per_s": 150}
    )
    assert summary[2] == {"instances": 1, "active_requests": 4}


@pytest.mark.django_db(transaction=True)
async def test_loads_within_the_interval_wait_for_its_end(running_bridge: Running) -> None:
    rows = await database_sync_to_async(give_endpoint_ids)()
    bridge, layer = running_bridge.bridge, running_bridge.layer
    on_a = await listen(layer, rows.a.pk)
    await _until_bridge_subscribed(running_bridge)
    bridge.interval = 3600.0  # a second push would wait an hour
    await publish_load(running_bridge.worker, rows.a.namespace, WorkerLoad(instance_id=ENDPOINT_A, active_requests=1))
    await receive_load(layer, on_a)
    for active in (2, 3):
        await publish_load(
            running_bridge.worker, rows.a.namespace, WorkerLoad(instance_id=ENDPOINT_A, active_requests=active)
        )
    await _until(lambda: bridge._instances[ENDPOINT_A].figures.ranks[0].active_requests == 3)
    assert bridge.pushed == 1
    assert bridge._instances[ENDPOINT_A].timer is not None  # the latest goes at the interval's end


@pytest.mark.django_db(transaction=True)
async def test_a_failed_subscription_task_is_logged_and_started_again(
    running_bridge: Running, caplog: pytest.LogCaptureFixture
) -> None:
    rows = await database_sync_to_async(give_endpoint_ids)()
    bridge, layer = running_bridge.bridge, running_bridge.layer
    on_a = await listen(layer, rows.a.pk)
    await _until_bridge_subscribed(running_bridge)
    directory_find = bridge._directory.find

    async def broken_once(endpoint_id: int) -> Watched | None:
        bridge._directory.find = directory_find  # type: ignore[method-assign]
        raise RuntimeError("a bug in the bridge")

    bridge._directory.find = broken_once  # type: ignore[method-assign]
    await publish_load(running_bridge.worker, rows.a.namespace, WorkerLoad(instance_id=ENDPOINT_A, active_requests=1))
    await _until(lambda: "background task 'load metrics' failed; restarting it" in caplog.text)
    await _until_bridge_subscribed(running_bridge)
    await publish_load(running_bridge.worker, rows.a.namespace, WorkerLoad(instance_id=ENDPOINT_A, active_requests=2))
    pushed = await receive_load(layer, on_a)
    assert 'data-active-requests="2"' in pushed["html"]


@pytest.mark.django_db(transaction=True)
async def test_a_load_from_a_worker_the_control_plane_does_not_know_is_dropped(running_bridge: Running) -> None:
    rows = await database_sync_to_async(give_endpoint_ids)()
    on_a = await listen(running_bridge.layer, rows.a.pk)
    await _until_bridge_subscribed(running_bridge)
    await publish_load(running_bridge.worker, "elsewhere", WorkerLoad(instance_id=0x999, active_requests=1))
    await running_bridge.worker.publish("flotilla.alpha.backend.load_metrics", b"not json")
    await publish_load(running_bridge.worker, rows.a.namespace, WorkerLoad(instance_id=ENDPOINT_A, active_requests=4))
    pushed = await receive_load(running_bridge.layer, on_a)
    assert pushed["instance"] == rows.a_instance.pk
    assert running_bridge.bridge.unknown >= 1


@pytest.mark.django_db(transaction=True)
async def test_a_disaggregated_pipelines_groups_have_their_instances_phases_summed_and_pushed(
    running_bridge: Running,
) -> None:
    split = await database_sync_to_async(split_pipeline)()
    layer, worker, namespace = running_bridge.layer, running_bridge.worker, split.pipeline.namespace
    channel = await listen(layer, split.pipeline.pk)
    await _until_bridge_subscribed(running_bridge)
    first, second = split.prefill_workers

    await publish_load(
        worker, namespace, WorkerLoad(instance_id=first, active_requests=0, prefills=1, prefill_seconds=0.1)
    )
    await publish_load(
        worker, namespace, WorkerLoad(instance_id=second, active_requests=0, prefills=3, prefill_seconds=0.06)
    )
    html = await receive_phases(layer, channel, split.prefill_group, "(2 instances)")
    assert f'id="phases-{split.prefill_group}"' in html and "<strong>4</strong> prompts prefilled" in html

    # The next interval: one prompt of 100 ms on the first, three of 20 ms on the second.
    await publish_load(
        worker, namespace, WorkerLoad(instance_id=first, active_requests=0, prefills=2, prefill_seconds=0.2)
    )
    await publish_load(
        worker, namespace, WorkerLoad(instance_id=second, active_requests=0, prefills=6, prefill_seconds=0.12)
    )
    html = await receive_phases(layer, channel, split.prefill_group, "<strong>8</strong> prompts prefilled")
    assert "<strong>40.0</strong> ms each" in html  # 160 ms over 4, not (100 + 20) / 2

    decode = WorkerLoad(
        instance_id=split.decode_worker, active_requests=1, handoffs=4, handoff_first_token_seconds=0.04
    )
    await publish_load(worker, namespace, decode)
    html = await receive_phases(layer, channel, split.decode_group, "KV handoffs taken")
    assert "<strong>4</strong> KV handoffs taken" in html and "first token <strong>10.0</strong> ms" in html
    assert "prefilled" not in html


@pytest.mark.django_db(transaction=True)
async def test_an_aggregated_pipeline_has_no_group_phases(running_bridge: Running) -> None:
    rows = await database_sync_to_async(give_endpoint_ids)()
    on_a = await listen(running_bridge.layer, rows.a.pk)
    await _until_bridge_subscribed(running_bridge)
    # Counters an aggregated worker never sends: still, its group is not one of a disaggregated pipeline.
    load = WorkerLoad(instance_id=ENDPOINT_A, active_requests=1, prefills=1, prefill_seconds=0.1)
    await publish_load(running_bridge.worker, rows.a.namespace, load)
    assert (await receive_load(running_bridge.layer, on_a))["instance"] == rows.a_instance.pk
    assert running_bridge.bridge.pushed_groups == 0 and not running_bridge.bridge._groups


async def test_a_stopped_instance_and_a_restarted_worker_leave_the_groups_totals_without_a_negative_rate() -> None:
    running = {1: Watched(10, 5, 50, "prefill"), 2: Watched(11, 5, 50, "prefill")}
    summaries: list[dict[str, Any]] = []

    async def read() -> dict[int, Watched]:
        return dict(running)

    async def render(watched: Watched, load: dict[str, Any]) -> str:
        return f"load of {watched.instance_id}"

    async def render_group(group_id: int, phases: dict[str, Any]) -> str:
        summaries.append(phases)
        return f"phases of {group_id}"

    class Layer:
        async def group_send(self, group: str, message: dict[str, Any]) -> None:
            assert group == pipeline_group(5)

    directory = InstanceDirectory(read, refresh_s=0.0, miss_refresh_s=0.0)  # each report reads the rows again
    bridge = LiveBridge(
        cast(NATS, None), cast(BaseChannelLayer, Layer()), directory, Supervisor(lambda: None), interval=0.0,
        render=render, render_group=render_group,
    )  # fmt: skip

    async def report(endpoint: int, prefills: int, seconds: float) -> None:
        load = WorkerLoad(instance_id=endpoint, active_requests=0, prefills=prefills, prefill_seconds=seconds)
        message = SimpleNamespace(subject="flotilla.split.prefill.load_metrics", data=msgspec.json.encode(load))
        await bridge._on_load(cast(Msg, message))
        pushed = len(summaries)
        await _until(lambda: len(summaries) > pushed)

    await report(1, 100, 5.0)
    await report(2, 3, 0.3)
    assert summaries[-1]["prefills"] == 103 and summaries[-1]["instances"] == 2
    await report(1, 2, 0.05)  # instance 10's worker restarted: 2 prompts since, of 25 ms
    assert summaries[-1]["prefills"] == 5 and summaries[-1]["prefills_per_s"] >= 0
    assert summaries[-1]["prefill_ms"] == pytest.approx(25.0)
    del running[1]  # instance 10 stopped
    await report(2, 4, 0.4)
    assert (summaries[-1]["prefills"], summaries[-1]["instances"]) == (4, 1)
    await bridge.close()


async def _until_bridge_subscribed(running: Running) -> None:
    """Return once the bridge's two subscriptions are registered on its connection and with the server."""
    nc = running.bridge._nc
    await _until(lambda: len(nc._subs) == 2)  # the supervisor's tasks subscribe on their first turn
    await flush(nc)


async def _until(condition: Callable[[], bool]) -> None:
    """Return once ``condition()`` holds: state inside the bridge, which sends no event when it changes."""
    async with asyncio.timeout(RECEIVE_S):
        while not condition():  # noqa: ASYNC110 - the bridge's counters and tables have no event to await
            await asyncio.sleep(0.01)


def test_ranks_are_summed_and_kv_blocks_counted_per_second() -> None:
    figures = InstanceFigures()
    figures.ranks[0] = WorkerLoad(instance_id=1, active_requests=3, running=2, kv_active_blocks=10, kv_total_blocks=100)
    figures.ranks[1] = WorkerLoad(
        instance_id=1, dp_rank=1, active_requests=1, running=1, kv_active_blocks=30, kv_total_blocks=100
    )
    figures.count(KvEventBatch(instance_id=1, event_id=1, events=[BlockStored(block_hashes=[1, 2, 3, 4])]), now=10.0)
    figures.count(KvEventBatch(instance_id=1, event_id=2, events=[BlockRemoved(block_hashes=[1, 2])]), now=10.5)
    figures.count(KvEventBatch(instance_id=1, event_id=0, events=[BlockStored(block_hashes=list(range(99)))]), now=11)
    load = figures.take(now=12.0)
    assert load["active_requests"] == 4
    assert load["running"] == 3
    assert load["kv_usage"] == pytest.approx(0.2)
    assert load["dp_ranks"] == 2
    assert load["kv_blocks_stored_per_s"] == pytest.approx(2.0)  # 4 in 2 s; a whole-state answer is no new work
    assert load["kv_blocks_removed_per_s"] == pytest.approx(1.0)
    assert "waiting" not in load  # no rank said


def test_lower_tiers_are_summed_over_the_ranks_best_first_with_their_mean_hit_rate() -> None:
    figures = InstanceFigures()
    figures.ranks[0] = WorkerLoad(
        instance_id=1,
        active_requests=0,
        tiers=[
            TierLoad(medium="disk", total_blocks=1000, used_blocks=10, hit_rate=0.0),
            TierLoad(medium="cpu", total_blocks=400, used_blocks=100, usage=0.25, hit_rate=0.5),
        ],
    )
    figures.ranks[1] = WorkerLoad(
        instance_id=1,
        dp_rank=1,
        active_requests=0,
        tiers=[TierLoad(medium="cpu", total_blocks=400, used_blocks=300, usage=0.75, hit_rate=0.1)],
    )
    assert figures.take(now=1.0)["tiers"] == [
        {"medium": "cpu", "total_blocks": 800, "used_blocks": 400, "usage": 0.5, "hit_rate": pytest.approx(0.3)},
        {"medium": "disk", "total_blocks": 1000, "used_blocks": 10, "usage": 0.01, "hit_rate": 0.0},
    ]


def test_a_tier_known_only_by_its_usage_keeps_the_ranks_mean_usage() -> None:
    figures = InstanceFigures()
    figures.ranks[0] = WorkerLoad(instance_id=1, active_requests=0, tiers=[TierLoad(medium="cpu", usage=0.2)])
    figures.ranks[1] = WorkerLoad(
        instance_id=1, dp_rank=1, active_requests=0, tiers=[TierLoad(medium="cpu", usage=0.4)]
    )
    assert figures.take(now=1.0)["tiers"] == [{"medium": "cpu", "usage": pytest.approx(0.3)}]


def test_a_worker_without_tiers_reports_none() -> None:
    figures = InstanceFigures()
    figures.ranks[0] = WorkerLoad(instance_id=1, active_requests=0, kv_usage=0.5)
    assert "tiers" not in figures.take(now=1.0)


def test_tokens_per_s_comes_from_the_ranks_generated_token_counters() -> None:
    figures = InstanceFigures()
    figures.ranks[0] = WorkerLoad(instance_id=1, active_requests=1, generated_tokens=100)
    figures.ranks[1] = WorkerLoad(instance_id=1, dp_rank=1, active_requests=1, generated_tokens=50)
    assert "tokens_per_s" not in figures.take(now=10.0)  # one reading is no rate yet

    figures.ranks[0] = WorkerLoad(instance_id=1, active_requests=1, generated_tokens=400)
    figures.ranks[1] = WorkerLoad(instance_id=1, dp_rank=1, active_requests=1, generated_tokens=150)
    assert figures.take(now=12.0)["tokens_per_s"] == pytest.approx(200.0)  # (550 - 150) tokens in 2 s

    figures.ranks[0] = WorkerLoad(instance_id=1, active_requests=1, generated_tokens=5)  # the worker restarted
    assert "tokens_per_s" not in figures.take(now=13.0)
    figures.ranks[0] = WorkerLoad(instance_id=1, active_requests=1, generated_tokens=35)
    assert figures.take(now=14.0)["tokens_per_s"] == pytest.approx(30.0)


def test_a_workers_part_in_disaggregated_serving_is_its_totals_and_the_mean_time_of_the_last_interval() -> None:
    figures = InstanceFigures()
    figures.ranks[0] = WorkerLoad(instance_id=1, active_requests=1, prefills=4, prefill_seconds=0.2)
    first = figures.take(now=10.0)
    assert (first["prefills"], first["prefill_ms"]) == (4, pytest.approx(50.0))  # 200 ms over 4
    assert "handoffs" in first and "handoff_first_token_ms" not in first  # a prefill worker takes none

    figures.ranks[0] = WorkerLoad(instance_id=1, active_requests=1, prefills=6, prefill_seconds=0.5)
    assert figures.take(now=11.0)["prefill_ms"] == pytest.approx(150.0)  # the 2 of this interval: 300 ms
    figures.ranks[0] = WorkerLoad(instance_id=1, active_requests=1, prefills=6, prefill_seconds=0.5)
    assert "prefill_ms" not in figures.take(now=12.0)  # none in this interval: no mean to show

    figures.ranks[0] = WorkerLoad(instance_id=1, active_requests=1, handoffs=2, handoff_first_token_seconds=0.03)
    restarted = figures.take(now=13.0)  # its counters began again
    assert (restarted["handoffs"], restarted["handoff_first_token_ms"]) == (2, pytest.approx(15.0))


def test_an_aggregated_worker_shows_no_phases() -> None:
    figures = InstanceFigures()
    figures.ranks[0] = WorkerLoad(instance_id=1, active_requests=2, generated_tokens=10)
    assert not {"prefills", "handoffs", "prefill_ms"} & set(figures.take(now=1.0))


def test_an_engine_without_a_counter_has_no_tokens_per_s() -> None:
    figures = InstanceFigures()
    for now in (1.0, 2.0):
        figures.ranks[0] = WorkerLoad(instance_id=1, active_requests=2)
        assert "tokens_per_s" not in figures.take(now=now)


async def test_the_directory_reads_again_on_a_miss_at_most_once_a_second() -> None:
    reads = 0
    now = 100.0

    async def read() -> dict[int, Watched]:
        nonlocal reads
        reads += 1
        return {7: Watched(instance_id=70, pipeline_id=1)}

    directory = InstanceDirectory(read, refresh_s=5.0, miss_refresh_s=1.0, clock=lambda: now)
    assert await directory.find(7) == Watched(70, 1)
    assert await directory.find(8) is None
    assert await directory.find(8) is None
    assert reads == 1
    now += 1.0
    assert await directory.find(8) is None
    assert reads == 2
    now += 5.0
    assert await directory.find(7) == Watched(70, 1)
    assert reads == 3


async def test_nats_lost_past_the_timeout_is_an_error_naming_the_server() -> None:
    now = 0.0
    watch = NatsWatch("nats://10.1.2.3:4222", timeout=30.0, clock=lambda: now)
    await watch.on_event("disconnected")
    now = 29.0
    watch.check()
    await watch.on_event("reconnected")  # the clock starts again at the next loss
    await watch.on_event("disconnected")
    now = 58.0
    watch.check()
    now = 59.0
    with pytest.raises(BridgeError, match=re.escape("lost NATS at nats://10.1.2.3:4222 for more than 30 s")):
        watch.check()


@pytest.mark.django_db
def test_the_bridge_exits_1_naming_the_nats_it_cannot_reach(caplog: pytest.LogCaptureFixture) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    with pytest.raises(CommandError) as raised, caplog.at_level(logging.WARNING):
        call_command("live_bridge", "--nats", url, "--nats-timeout", "1.5")
    assert raised.value.returncode == 1
    assert f"cannot reach NATS at {url}" in str(raised.value)
    assert "set NATS_SERVER" in str(raised.value)


def test_a_malformed_nats_address_is_refused_naming_the_flag() -> None:
    with pytest.raises(CommandError, match="--nats: 'http://x' is not of the form nats://host:port"):
        call_command("live_bridge", "--nats", "http://x")


def test_a_sample_window_under_a_second_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_METRICS_SAMPLE_S", "0.5")
    with pytest.raises(CommandError, match="FLOTILLA_METRICS_SAMPLE_S") as raised:
        call_command("live_bridge", "--nats", f"nats://127.0.0.1:{free_port()}", "--nats-timeout", "0.5")
    assert raised.value.returncode == 2
