"""The planner's loop (controlplane/planning/loop.py) against a real NATS: workers' load reports, published by
the test on the subject workers publish on, make a pipeline in load mode scale through the audited action;
advisory mode records and does not act; a second planner waits for the lease; what cannot be placed and a
gateway that does not answer (or answers nonsense) are said in the decision's reason."""

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgspec
import pytest
from asgiref.sync import sync_to_async
from nats.aio.client import Client as NATS

from controlplane.audit.models import AuditEntry
from controlplane.deployments import upkeep
from controlplane.deployments.models import Instance, Pipeline, WorkerGroup
from controlplane.planning.loop import PlannerLoop
from controlplane.planning.models import PlannerDecision
from runtime.cluster.nats_connection import connect_nats, flush
from runtime.kv.events import WorkerLoad
from tests.controlplane.factories import TEST_ACTOR, deploy, make_node, run_instance
from tests.infra import NatsServer
from tests.servers import free_port

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]
WAIT_S = 10.0
# Load mode, acting at once: no cooldown, and a busy KV cache is the signal.
LOAD_MODE: dict[str, Any] = {"stability": {"cooldown_s": 0, "reversal_s": 0, "down_window_s": 0}}


def ready_pipeline(gpus: tuple[float, ...] = (80, 80), **planner: Any) -> tuple[Pipeline, int]:
    """Pipeline "chat" (1 GPU per replica, 1 replica, ready) with planner targets; its worker's endpoint id."""
    make_node("gpu-a", gpus)
    pipeline = deploy("chat", gpus_per_replica=1, planner=LOAD_MODE | planner)
    upkeep.place_pending_instances(TEST_ACTOR)
    instance = run_instance(Instance.objects.get())
    assert instance.endpoint_instance_id is not None
    return pipeline, instance.endpoint_instance_id


@pytest.fixture
async def worker(nats_server: NatsServer) -> AsyncIterator[NATS]:
    """A worker's NATS connection, to publish load reports on."""
    nc = await connect_nats(nats_server.url, name="worker", wait=WAIT_S)
    yield nc
    await nc.close()


@pytest.fixture
async def planner_nc(nats_server: NatsServer) -> AsyncIterator[NATS]:
    nc = await connect_nats(nats_server.url, name="planner", wait=WAIT_S)
    yield nc
    await nc.close()


class WatchedLoop(PlannerLoop):
    """The loop, telling the test when a load report has reached it."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.received = asyncio.Event()

    async def on_load(self, message: Any) -> None:
        await super().on_load(message)
        self.received.set()


async def report_load(loop: WatchedLoop, worker: NATS, endpoint_id: int, kv_usage: float) -> None:
    """Publish a worker's load report as the worker would, and wait for the planner to have it."""
    report = WorkerLoad(instance_id=endpoint_id, active_requests=4, running=4, waiting=0, kv_usage=kv_usage)
    loop.received.clear()
    await worker.publish("flotilla.chat.backend.load_metrics", msgspec.json.encode(report))
    await flush(worker)
    await asyncio.wait_for(loop.received.wait(), WAIT_S)
    assert loop.book.reports[(endpoint_id, 0)][1] == report


async def started(planner_nc: NATS, **options: Any) -> WatchedLoop:
    loop = WatchedLoop(gateway_url=options.pop("gateway_url", None), interval_s=1.0, **options)
    await loop.subscribe(planner_nc)
    await flush(planner_nc)
    return loop


def replicas() -> int:
    return WorkerGroup.objects.get().replicas


async def test_a_busy_worker_makes_the_planner_scale_its_group_up_through_the_audited_action(
    worker: NATS, planner_nc: NATS
) -> None:
    pipeline, endpoint_id = await sync_to_async(ready_pipeline)()
    loop = await started(planner_nc)
    await report_load(loop, worker, endpoint_id, kv_usage=0.95)

    report = await loop.turn()

    assert (report.decided, report.acted) == (1, 1)
    assert await sync_to_async(replicas)() == 2
    decision = await PlannerDecision.objects.aget(pipeline=pipeline)
    assert (decision.current, decision.desired, decision.mode, decision.acted) == (1, 2, "load", True)
    assert "KV usage 95%" in decision.reason
    entry = await AuditEntry.objects.aget(action="pipeline.scale")
    assert entry.actor_name == "system:planner"
    assert entry.after is not None and "KV usage 95%" in entry.after["reason"]
    await loop.release()


async def test_advisory_mode_records_the_decision_and_does_not_act(worker: NATS, planner_nc: NATS) -> None:
    pipeline, endpoint_id = await sync_to_async(ready_pipeline)(advisory=True)
    loop = await started(planner_nc)
    await report_load(loop, worker, endpoint_id, kv_usage=0.95)

    report = await loop.turn()

    assert (report.decided, report.acted) == (1, 0)
    assert await sync_to_async(replicas)() == 1
    decision = await PlannerDecision.objects.aget(pipeline=pipeline)
    assert (decision.desired, decision.advisory, decision.acted) == (2, True, False)
    assert decision.reason.endswith("advisory: not acted on")
    assert not await AuditEntry.objects.filter(action="pipeline.scale").aexists()
    await loop.release()


async def test_a_second_planner_waits_for_the_lease_and_takes_over_when_the_first_lets_go(
    planner_nc: NATS,
) -> None:
    await sync_to_async(ready_pipeline)()
    first = await started(planner_nc, holder="first")
    second = await started(planner_nc, holder="second")

    assert (await first.turn()).held_lease
    waiting = await second.turn()
    assert not waiting.held_lease and waiting.decided == 0

    await first.release()
    assert (await second.turn()).held_lease
    await second.release()


async def test_a_scale_up_that_cannot_be_placed_is_recorded_with_placements_reason_and_not_made(
    worker: NATS, planner_nc: NATS
) -> None:
    pipeline, endpoint_id = await sync_to_async(ready_pipeline)(gpus=(80,))
    loop = await started(planner_nc)
    await report_load(loop, worker, endpoint_id, kv_usage=0.95)

    report = await loop.turn()

    assert report.acted == 0
    assert await sync_to_async(replicas)() == 1
    decision = await PlannerDecision.objects.aget(pipeline=pipeline)
    assert not decision.acted
    assert "not acted: 1 more replica(s) cannot be placed" in decision.reason
    await loop.release()


async def test_an_unreachable_gateway_is_said_and_the_planner_goes_on_in_load_mode(
    worker: NATS, planner_nc: NATS
) -> None:
    pipeline, endpoint_id = await sync_to_async(ready_pipeline)()
    gateway = f"http://127.0.0.1:{free_port()}"
    loop = await started(planner_nc, gateway_url=gateway)
    await report_load(loop, worker, endpoint_id, kv_usage=0.95)

    report = await loop.turn()

    assert any(gateway in problem for problem in report.problems)
    assert report.acted == 1
    decision = await PlannerDecision.objects.aget(pipeline=pipeline)
    assert decision.reason.startswith("gateway metrics unreadable: load mode; ")
    await loop.release()


async def test_an_unreachable_prometheus_is_said_and_the_planner_goes_on_in_load_mode(
    worker: NATS, planner_nc: NATS
) -> None:
    pipeline, endpoint_id = await sync_to_async(ready_pipeline)()
    prometheus = f"http://127.0.0.1:{free_port()}"
    loop = await started(planner_nc, gateway_url=None, prometheus_url=prometheus)
    await report_load(loop, worker, endpoint_id, kv_usage=0.95)

    report = await loop.turn()

    assert any(f"{prometheus}/api/v1/query could not be read" in problem for problem in report.problems)
    assert report.acted == 1
    decision = await PlannerDecision.objects.aget(pipeline=pipeline)
    assert decision.reason.startswith("Prometheus unreadable: load mode; ")
    await loop.release()


async def test_without_reports_load_mode_holds(planner_nc: NATS) -> None:
    pipeline, _ = await sync_to_async(ready_pipeline)()
    loop = await started(planner_nc)

    await loop.turn()

    decision = await PlannerDecision.objects.aget(pipeline=pipeline)
    assert (decision.desired, decision.acted) == (1, False)
    assert "holding" in decision.reason
    await loop.release()


@pytest.fixture
def nonsense_gateway() -> Iterator[str]:
    """A gateway whose /metrics answers 200 with a page that is not Prometheus text: its base URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<html><body>{{ metrics }}</body></html>"
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


async def test_a_gateway_answering_what_is_not_metrics_is_said_and_the_planner_goes_on_in_load_mode(
    worker: NATS, planner_nc: NATS, nonsense_gateway: str
) -> None:
    pipeline, endpoint_id = await sync_to_async(ready_pipeline)()
    loop = await started(planner_nc, gateway_url=nonsense_gateway)
    await report_load(loop, worker, endpoint_id, kv_usage=0.95)

    report = await loop.turn()  # before: the parser's ValueError left the turn, and the process with it

    assert any(
        f"{nonsense_gateway}/metrics answered what the planner cannot read: not Prometheus text" in problem
        for problem in report.problems
    ), report.problems
    assert report.acted == 1
    decision = await PlannerDecision.objects.aget(pipeline=pipeline)
    assert decision.reason.startswith("gateway metrics unreadable: load mode; ")
    await loop.release()


async def test_an_ingress_process_that_does_not_answer_makes_the_whole_reading_unreadable_naming_it(
    worker: NATS, planner_nc: NATS, nonsense_gateway: str
) -> None:
    """Of two ingress processes (``--ingress-metrics``), one gone: the other's count alone would under-count."""
    pipeline, endpoint_id = await sync_to_async(ready_pipeline)()
    gone = f"http://127.0.0.1:{free_port()}"
    loop = await started(planner_nc, gateway_url="http://127.0.0.1:1", ingress_metrics_urls=[nonsense_gateway, gone])
    await report_load(loop, worker, endpoint_id, kv_usage=0.95)

    report = await loop.turn()

    problems = " ".join(report.problems)
    assert f"{gone}/metrics could not be read" in problems and f"{nonsense_gateway}/metrics answered" in problems
    assert "http://127.0.0.1:1/metrics" not in problems  # the gateway's own /metrics is not read in their place
    assert report.acted == 1
    decision = await PlannerDecision.objects.aget(pipeline=pipeline)
    assert decision.reason.startswith("ingress metrics unreadable: load mode; ")
    await loop.release()
