"""An instance page's socket (``/ws/instances/<pk>/``, on a real Redis): it hears its pipeline's group and keeps
what is about its instance: its state, placement, timeline and restarts re-rendered, its load forwarded."""

import pytest
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer

from controlplane.accounts.models import Role
from controlplane.audit.records import Actor
from controlplane.deployments import instances as instance_actions
from controlplane.deployments import upkeep
from controlplane.deployments.instance_states import InstanceState
from controlplane.deployments.models import Instance
from controlplane.live.consumers import NOT_FOUND
from controlplane.live.groups import html, pipeline_group
from runtime.fleet_contract.reports import InstanceReport
from tests.controlplane.factories import TEST_ACTOR, deploy, make_node
from tests.controlplane.live_fixtures import communicator, connected, live_layer, session_cookie

__all__ = ["live_layer"]  # a fixture
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("live_layer")]
RECEIVE_S = 10.0  # generous on a busy machine; each wait ends as soon as the message arrives


def two_replicas() -> tuple[Instance, Instance]:
    """Two placed CPU replicas of pipeline "alpha" on node gpu-a (sync)."""
    make_node("gpu-a")
    deploy("alpha", replicas=2)
    upkeep.place_pending_instances(TEST_ACTOR)
    first, second = Instance.objects.order_by("replica")
    return first, second


def report_ready(instance_id: int) -> None:
    report = InstanceReport(state=InstanceState.READY, pid=7)
    instance_actions.report_instance_state(Actor.agent("gpu-a"), "gpu-a", instance_id, report)


async def test_an_instance_socket_hears_its_instance_only_as_the_pages_detail() -> None:
    mine, other = await database_sync_to_async(two_replicas)()
    socket = await connected(f"/ws/instances/{mine.pk}/", Role.READ_ONLY, "reader")  # its detail, caught up
    await database_sync_to_async(report_ready)(other.pk)
    await database_sync_to_async(report_ready)(mine.pk)
    while "pending → ready" not in (text := await socket.receive_from(timeout=RECEIVE_S)):
        # Nothing of the other replica, and no element the page does not have (htmx would log an error).
        assert text.startswith(f'<div id="detail-{mine.pk}">'), text[:200]
    assert f"instance-{other.pk}" not in text and f"detail-{other.pk}" not in text
    await socket.disconnect()


async def test_an_instance_socket_forwards_its_instances_load_only() -> None:
    mine, other = await database_sync_to_async(two_replicas)()
    socket = await connected(f"/ws/instances/{mine.pk}/", Role.READ_ONLY, "reader")
    layer = get_channel_layer()
    assert layer is not None
    group = pipeline_group(mine.pipeline_id)
    await layer.group_send(group, dict(html(f'<div id="load-{other.pk}">other</div>', instance=other.pk)))
    await layer.group_send(group, dict(html(f'<div id="load-{mine.pk}">mine</div>', instance=mine.pk)))
    while f'id="load-{mine.pk}"' not in (text := await socket.receive_from(timeout=RECEIVE_S)):
        assert f"load-{other.pk}" not in text  # the set-up's own notices may come first: the detail again
    assert text == f'<div id="load-{mine.pk}">mine</div>'
    await socket.disconnect()


async def test_a_socket_for_an_instance_that_does_not_exist_is_closed_with_4404() -> None:
    cookie = await database_sync_to_async(session_cookie)("alice", Role.READ_ONLY)
    socket = communicator("/ws/instances/999999/", cookie)
    accepted, _ = await socket.connect(timeout=RECEIVE_S)
    assert accepted
    closing = await socket.receive_output(timeout=RECEIVE_S)
    assert closing["code"] == NOT_FOUND
    await socket.disconnect()  # as the ASGI server tells the consumer after a close
