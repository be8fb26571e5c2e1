"""Change notices leave after commit, through the publisher's own thread; renders are shared between
sockets; and a Redis that is gone costs a logged warning and a socket the browser retries, never the change."""

import asyncio
import logging
from typing import Any

import pytest
import redis.exceptions
from channels.db import database_sync_to_async
from channels.layers import InMemoryChannelLayer, get_channel_layer
from django.apps import apps
from django.db import transaction

from controlplane.accounts.models import Role
from controlplane.audit.models import AuditEntry
from controlplane.audit.records import Actor
from controlplane.fleet import actions as fleet_actions
from controlplane.fleet.models import Node
from controlplane.live import publisher as publisher_module
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


class SlowLayer(InMemoryChannelLayer):
    """A layer that answers every send, each after ``delay_s``: a busy Redis, or a process whose other threads
    hold the GIL."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    async def group_send(self, group: str, message: dict[str, Any]) -> None:
        await asyncio.sleep(self.delay_s)


def test_a_burst_that_takes_longer_to_send_than_one_sends_deadline_is_sent_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Issue 39: a batch had one deadline for all its sends, so a burst of notices to a layer that answered each
    # in milliseconds was dropped whole once the batch outgrew the deadline.
    monkeypatch.setattr(publisher_module, "SEND_TIMEOUT_S", 0.5)
    layer = SlowLayer(delay_s=0.02)
    publisher = Publisher(layer=lambda: layer)
    for entry in range(1, 201):  # audit entries: each a notice of its own (200 x 0.02 s = 4 s one at a time)
        publisher.publish("audit", entry, {AUDIT})
    assert publisher.flush(RECEIVE_S * 3)
    assert publisher.sent == 200
    assert (publisher.dropped, publisher.failed) == (0, 0)


def test_a_layer_that_does_not_answer_one_send_in_time_costs_its_batch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(publisher_module, "SEND_TIMEOUT_S", 0.05)
    publisher = Publisher(layer=lambda: SlowLayer(delay_s=RECEIVE_S))
    with caplog.at_level(logging.WARNING, logger="controlplane.live.publisher"):
        publisher.publish("node", 1, {NODES, PIPELINES})
        assert publisher.flush(RECEIVE_S)
    assert (publisher.sent, publisher.dropped, publisher.failed) == (0, 2, 1)
    assert "TimeoutError" in caplog.text and "2 change notice(s) dropped" in caplog.text


@pytest.mark.django_db(transaction=True)
async def test_sockets_that_heard_of_a_change_share_one_render_of_it() -> None:
    node = await database_sync_to_async(make_node)("gpu-a")
    renders = SharedRenders()
    heard_at = asyncio.get_running_loop().time()
    first, second = await asyncio.gather(
        renders.render([(("node", node.pk), heard_at)], can_act=True),
        renders.render([(("node", node.pk), heard_at)], can_act=True),
    )
    assert first == second
    assert f'id="node-{node.pk}"' in first
    assert renders.started == 1
    # A change heard after that render began needs a render of its own.
    await renders.render([(("node", node.pk), asyncio.get_running_loop().time() + 1)], can_act=True)
    assert renders.started == 2


@pytest.mark.django_db(transaction=True)
async def test_a_deleted_row_renders_as_its_removal() -> None:
    html = await SharedRenders().render([(("instance", 424242), 0.0)], can_act=True)
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
