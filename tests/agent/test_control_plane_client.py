"""The agent's control-plane client against a stand-in control plane (httpx's MockTransport) that can be
taken down and brought back: reports are kept through an outage (the latest per instance) and sent when
it is back, in order; stale ones are dropped, not retried; outages are logged once; tokens rejected."""

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import httpx
import msgspec
import pytest

from agent.control_plane_client import (
    ControlPlaneClient,
    DownloadReport,
    InstanceReport,
    NodeNotRegistered,
    NodeReport,
    TokenRejected,
    fit_reason,
    node_report,
)
from agent.inventory import NodeInventory
from runtime.backoff import Backoff
from runtime.errors import ConfigError

REPORT = NodeReport(
    name="node-a",
    address="10.0.0.5",
    labels={},
    cpu_count=8,
    memory_total_bytes=1 << 35,
    memory_available_bytes=1 << 34,
    agent_version="test",
    gpus=[],
)


class StandIn:
    """Answers the agent endpoints like the control plane would; ``up = False`` refuses connections."""

    def __init__(self) -> None:
        self.up = True
        self.received: list[tuple[str, str, object]] = []
        #: path -> statuses to answer in turn (the last one repeats); 200 otherwise.
        self.statuses: dict[str, list[int]] = {}
        #: Connection attempts refused while down.
        self.refused = 0
        #: Bring the control plane up after this many refused connections (None: stay as it is).
        self.up_after: int | None = None

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if not self.up:
            self.refused += 1
            if self.up_after is not None and self.refused >= self.up_after:
                self.up = True
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        path = request.url.path
        self.received.append((request.method, path, json.loads(request.content) if request.content else None))
        statuses = self.statuses.get(path, [200])
        status = statuses.pop(0) if len(statuses) > 1 else statuses[0]
        if status == 401:
            return httpx.Response(401, json={"detail": "unknown or revoked token"})
        if status == 200 and path.endswith("/heartbeat/"):
            return httpx.Response(200, json={"name": "node-a", "state": "online", "draining": False})
        if status == 200 and path.endswith("/instances/"):
            return httpx.Response(200, json=[{"id": 4, "state": "ready", "model": {"id": 2, "name": "m"}}])
        return httpx.Response(status, json={"detail": f"answered {status}"})

    def posts(self) -> list[tuple[str, object]]:
        return [(path, body) for method, path, body in self.received if method == "POST"]


@pytest.fixture
def stand_in() -> StandIn:
    return StandIn()


@pytest.fixture
async def client(stand_in: StandIn) -> AsyncIterator[ControlPlaneClient]:
    async with ControlPlaneClient(
        "http://control-plane:8000/",
        "flt_token",
        node="node-a",
        backoff=Backoff(0.001, 0.01),
        transport=httpx.MockTransport(stand_in),
    ) as connected:
        yield connected


async def test_reports_made_during_an_outage_are_sent_when_it_ends_the_latest_per_instance_in_order(
    client: ControlPlaneClient, stand_in: StandIn
) -> None:
    stand_in.up = False
    client.report_instance(1, InstanceReport(state="downloading", download_progress=0.5))
    client.report_instance(2, InstanceReport(state="starting", pid=22))
    client.report_instance(1, InstanceReport(state="starting", pid=11))
    client.report_download(3, DownloadReport(state="downloading", bytes_done=5, bytes_total=10))
    client.report_instance(1, InstanceReport(state="ready", pid=11, endpoint_instance_id=0xABC))
    client.report_download(3, DownloadReport(state="done", bytes_done=10, bytes_total=10))

    assert not await client.flush(0.2)  # nothing can be sent while it is down
    assert client.pending_reports == 3
    stand_in.up = True
    assert await client.flush(10)

    assert stand_in.posts() == [
        ("/api/v1/agent/instances/1/state/", {"state": "ready", "pid": 11, "endpoint_instance_id": 0xABC}),
        ("/api/v1/agent/instances/2/state/", {"state": "starting", "pid": 22}),
        ("/api/v1/agent/downloads/", {"model": 3, "state": "done", "bytes_done": 10, "bytes_total": 10}),
    ]


async def test_an_outage_is_logged_once_when_it_starts_and_once_when_it_ends(
    client: ControlPlaneClient, stand_in: StandIn, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agent.control_plane_client")
    stand_in.up = False
    for _ in range(3):
        assert await client.heartbeat(REPORT) is None
    client.report_instance(1, InstanceReport(state="ready"))
    assert not await client.flush(0.1)
    assert not client.reachable
    stand_in.up = True
    assert await client.heartbeat(REPORT) is not None
    assert await client.flush(10)

    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "cannot reach the control plane at http://control-plane:8000 (ConnectError" in warnings[0]
    assert sum("answers again" in r.getMessage() for r in caplog.records) == 1


async def test_a_report_the_control_plane_declines_as_stale_is_dropped_not_retried(
    client: ControlPlaneClient, stand_in: StandIn
) -> None:
    stand_in.statuses["/api/v1/agent/instances/1/state/"] = [409]
    client.report_instance(1, InstanceReport(state="ready", pid=5))
    client.report_instance(2, InstanceReport(state="stopped"))
    assert await client.flush(10)
    assert [path for path, _ in stand_in.posts()] == [
        "/api/v1/agent/instances/1/state/",
        "/api/v1/agent/instances/2/state/",
    ]


async def test_a_report_answered_with_a_server_error_is_sent_again(
    client: ControlPlaneClient, stand_in: StandIn
) -> None:
    stand_in.statuses["/api/v1/agent/instances/1/state/"] = [503, 500, 200]
    client.report_instance(1, InstanceReport(state="failed", reason="the worker crashed"))
    assert await client.flush(10)
    assert len(stand_in.posts()) == 3
    assert client.reachable


async def test_a_rejected_token_stops_the_sending_and_says_how_to_get_a_token(
    client: ControlPlaneClient, stand_in: StandIn
) -> None:
    stand_in.statuses["/api/v1/agent/instances/1/state/"] = [401]
    client.report_instance(1, InstanceReport(state="ready"))
    rejected = await client.rejected
    assert "rejected the agent token of node node-a (401: unknown or revoked token)" in str(rejected)
    assert "manage.py createtoken --agent node-a" in str(rejected)
    assert not await client.flush(10)  # returns at once: nothing more is sent, the agent stops
    stand_in.statuses["/api/v1/agent/heartbeat/"] = [401]
    with pytest.raises(TokenRejected):
        await client.heartbeat(REPORT)


async def test_registration_waits_for_the_control_plane(client: ControlPlaneClient, stand_in: StandIn) -> None:
    stand_in.up = False
    stand_in.up_after = 3
    await client.register(REPORT)
    assert stand_in.refused == 3
    [(path, body)] = stand_in.posts()
    assert path == "/api/v1/agent/register/"
    assert isinstance(body, dict) and (body["name"], body["cpu_count"]) == ("node-a", 8)


async def test_registration_and_heartbeats_carry_the_engines_the_node_runs(
    client: ControlPlaneClient, stand_in: StandIn
) -> None:
    inventory = NodeInventory(
        hostname="host-a", cpu_count=8, memory_total_bytes=1 << 35, memory_available_bytes=0, gpus=[]
    )
    report = node_report(inventory, name="node-a", engines={"mocker", "llamacpp", "echo_full"})
    await client.register(report)
    await client.heartbeat(report)
    sent = [(path, body["engines"]) for path, body in stand_in.posts() if isinstance(body, dict)]
    engines = ["echo_full", "llamacpp", "mocker"]
    assert sent == [("/api/v1/agent/register/", engines), ("/api/v1/agent/heartbeat/", engines)]


async def test_a_heartbeat_carries_the_cpu_utilisation_once_measured_and_leaves_it_out_before(
    client: ControlPlaneClient, stand_in: StandIn
) -> None:
    first = NodeInventory(hostname="host-a", cpu_count=8, memory_total_bytes=1 << 35, memory_available_bytes=0, gpus=[])
    measured = msgspec.structs.replace(first, cpu_utilization_percent=37.5)
    await client.register(node_report(first, name="node-a"))
    await client.heartbeat(node_report(measured, name="node-a"))
    sent = [body for _, body in stand_in.posts() if isinstance(body, dict)]
    assert "cpu_utilization_percent" not in sent[0]  # not null: older control planes never see the field
    assert sent[1]["cpu_utilization_percent"] == 37.5


async def test_registration_refused_for_the_token_or_the_url_says_which(
    client: ControlPlaneClient, stand_in: StandIn
) -> None:
    stand_in.statuses["/api/v1/agent/register/"] = [403]
    with pytest.raises(TokenRejected, match=r"\(403: answered 403\)"):
        await client.register(REPORT)
    stand_in.statuses["/api/v1/agent/register/"] = [404]
    with pytest.raises(ConfigError, match="give the control plane's base URL"):
        await client.register(REPORT)


async def test_a_heartbeat_for_a_node_the_control_plane_forgot_asks_to_register_again(
    client: ControlPlaneClient, stand_in: StandIn
) -> None:
    stand_in.statuses["/api/v1/agent/heartbeat/"] = [404]
    with pytest.raises(NodeNotRegistered):
        await client.heartbeat(REPORT)


async def test_the_instances_of_the_node_are_listed_with_their_models(client: ControlPlaneClient) -> None:
    [instance] = await client.list_instances()
    assert (instance.id, instance.state, instance.model and instance.model.id) == (4, "ready", 2)


def test_a_long_reason_is_cut_to_what_the_api_takes_keeping_its_start_and_its_end() -> None:
    reason = "the worker failed with exit code 3; the last lines of its log:\n" + "x" * 6000 + "\nboom"
    cut = fit_reason(reason)
    assert len(cut) == 4000
    assert cut.startswith("the worker failed with exit code 3") and cut.endswith("\nboom")
    assert fit_reason("short") == "short"


@pytest.mark.parametrize("status", [403, 404, 409])
async def test_a_report_the_control_plane_refuses_casts_doubt_on_the_workers(
    client: ControlPlaneClient, stand_in: StandIn, status: int
) -> None:
    stand_in.statuses["/api/v1/agent/instances/5/state/"] = [status]
    client.report_instance(5, InstanceReport(state="ready"))
    async with asyncio.timeout(10):
        why = await client.doubt()
    assert why == f"the control plane answered {status} to instance 5's state ready"


async def test_reports_taken_or_about_downloads_cast_no_doubt(client: ControlPlaneClient, stand_in: StandIn) -> None:
    stand_in.statuses["/api/v1/agent/downloads/"] = [409]
    client.report_instance(5, InstanceReport(state="ready"))
    client.report_download(3, DownloadReport(state="done", bytes_done=1, bytes_total=1))
    assert await client.flush(10)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.1):
            await client.doubt()


async def test_the_control_plane_answering_again_after_an_outage_casts_doubt_on_the_workers(
    client: ControlPlaneClient, stand_in: StandIn
) -> None:
    assert await client.heartbeat(REPORT) is not None  # answering without an outage first is no news
    stand_in.up = False
    assert await client.heartbeat(REPORT) is None
    stand_in.up = True
    assert await client.heartbeat(REPORT) is not None
    async with asyncio.timeout(10):
        why = await client.doubt()
    assert why.startswith("the control plane may have changed it during the ") and "this agent was cut off" in why
    with pytest.raises(TimeoutError):  # one doubt per outage
        async with asyncio.timeout(0.1):
            await client.doubt()


async def test_the_instances_are_listed_with_the_attempt_the_control_plane_is_at() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=[{"id": 4, "state": "ready", "attempt": 2}, {"id": 5, "state": "pending"}])

    async with ControlPlaneClient("http://cp:8000", "flt_t", node="node-a", transport=httpx.MockTransport(answer)) as c:
        assert [(row.id, row.attempt) for row in await c.list_instances()] == [(4, 2), (5, None)]
