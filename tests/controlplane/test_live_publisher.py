"""Change notices leave after commit, through the publisher's own thread; renders are shared between
sockets; and a Redis that is gone costs a logged warning and a socket the browser retries, never the change."""

import asyncio
import logging

import pytest
import redis.exceptions
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.apps import apps
from django.db import transaction

from controlplane.accounts.models import Role
from controlplane.audit.models import AuditEntry
from controlplane.audit.records import Actor
from controlplane.fleet import actions as fleet_actions
from controlplane.fleet.models import Node
from controlplane.live.consumers import SERVER_ERROR
from controlplane.live.events import notices_of_entry
from controlplane.live.groups import AUDIT, NODES, PIPELINES, pipeline_group
from controlplane.live.layer import channel_layers
from controlplane.live.publisher import Publisher
from controlplane.live.rendering import SharedRenders, removal
from tests.controlplane.factories import deploy, make_node, node_report
from tests.controlplane.live_fixtures import communicator, live_layer, session_cookie
from tests.servers import free_port

__all__ = ["live_layer"]  # a fixture
RECEIVE_S = 10.0


@pytest.fixture
def dead_redis(settings: object, monkeypatch: pytest.MonkeyPatch) -> str:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    monkeypatch.setenv("FLOTILLA_REDIS_URL", url)
    settings.CHANNEL_LAYERS = channel_layers()  # type: ignore[attr-defined]
    return url


@pytest.mark.django_db(transaction=True)
def test_an_action_commits_and_returns_while_redis_is_gone(dead_redis: str) -> None:
    publisher: Publisher = apps.get_app_config("live").publisher  # type: ignore[attr-defined]
    node = make_node("gpu-a")
    assert Node.objects.filter(pk=node.pk).exists()
    assert publisher.flush(RECEIVE_S)  # sent, failed, dropped: nothing is left waiting


@pytest.mark.django_db(transaction=True)
def test_a_send_that_fails_is_logged_with_the_layers_address(dead_redis: str, caplog: pytest.LogCaptureFixture) -> None:
    publisher = Publisher()
    with caplog.at_level(logging.WARNING, logger="controlplane.live.publisher"):
        publisher.publish("node", 1, {NODES})
        assert publisher.flush(RECEIVE_S)
    assert publisher.failed == 1
    assert f"cannot reach the channel layer at {dead_redis}" in caplog.text


@pytest.mark.django_db(transaction=True)
@pytest.mark.postgresql
def test_a_rolled_back_change_sends_nothing(live_layer: Publisher) -> None:
    make_node("gpu-a")
    assert live_layer.flush(RECEIVE_S)
    sent = live_layer.sent

    @transaction.atomic
    def heartbeat_then_fail() -> None:
        fleet_actions.heartbeat(Actor.agent("gpu-a"), "gpu-a", node_report((80, 80), used_gib=5))
        raise RuntimeError("the request failed after the heartbeat")

    with pytest.raises(RuntimeError):
        heartbeat_then_fail()
    assert live_layer.flush(RECEIVE_S)
    assert live_layer.sent == sent


@pytest.mark.django_db(transaction=True)
async def test_notices_of_one_row_in_a_burst_become_one_per_group(live_layer: Publisher) -> None:
    layer = get_channel_layer()
    assert layer is not None
    channel = await layer.new_channel()
    await layer.group_add(NODES, channel)
    publisher = Publisher()
    for _ in range(50):
        publisher.publish("node", 7, {NODES})
    await asyncio.to_thread(publisher.flush, RECEIVE_S)
    assert 1 <= publisher.sent < 50  # the thread may wake between the first notice and the rest
    assert await layer.receive(channel) == {"type": "live.changed", "kind": "node", "id": 7}


@pytest.mark.django_db(transaction=True)
async def test_sockets_that_heard_of_a_change_share_one_render_of_it() -> None:
    node = await database_sync_to_async(make_node)("gpu-a")
    renders = SharedRenders()
    heard_at = asyncio.get_running_loop().time()
    first, second = await asyncio.gather(
        renders.render([(("node", node.pk), heard_at)]), renders.render([(("node", node.pk), heard_at)])
    )
    assert first == second
    assert f'id="node-{node.pk}"' in first
    assert renders.started == 1
    # A change heard after that render began needs a render of its own.
    await renders.render([(("node", node.pk), asyncio.get_running_loop().time() + 1)])
    assert renders.started == 2


@pytest.mark.django_db(transaction=True)
async def test_a_deleted_row_renders_as_its_removal() -> None:
    html = await SharedRenders().render([(("instance", 424242), 0.0)])
    assert html == removal("instance", 424242) == '<div id="instance-424242" hx-swap-oob="delete"></div>'


@pytest.mark.django_db
def test_an_instances_audit_entry_tells_its_pipeline_and_the_fleet() -> None:
    pipeline = deploy("alpha")
    instance = pipeline.instances.get()
    created = AuditEntry.objects.get(action="instance.create", target_id=str(instance.pk))
    notices = {(kind, row_id): groups for kind, row_id, groups in notices_of_entry(created)}
    # A new instance has no element yet: its pipeline's list is rendered again.
    assert notices[("instances", pipeline.pk)] == {pipeline_group(pipeline.pk)}
    assert notices[("pipeline", pipeline.pk)] == {PIPELINES, pipeline_group(pipeline.pk)}
    assert notices[("audit", created.pk)] == {AUDIT}


@pytest.mark.django_db(transaction=True)
async def test_a_socket_opened_while_redis_is_gone_is_closed_for_the_browser_to_retry(dead_redis: str) -> None:
    cookie = await database_sync_to_async(session_cookie)("alice", Role.OPERATOR)
    socket = communicator("/ws/fleet/", cookie)
    accepted, _ = await socket.connect(timeout=RECEIVE_S)
    assert accepted
    closing = await socket.receive_output(timeout=RECEIVE_S)
    assert closing["code"] == SERVER_ERROR
    # As the ASGI server tells the consumer after a close. Channels' own listener on the socket's channel
    # failed with Redis gone, and the consumer ends raising that failure: it ends, which is what matters
    # here (left to the loop's teardown, a consumer hung a CI run once).
    with pytest.raises(redis.exceptions.ConnectionError):
        await socket.disconnect()
