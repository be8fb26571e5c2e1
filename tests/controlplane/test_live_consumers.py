"""The dashboard's websockets (Channels' WebsocketCommunicator, the Redis channel layer on a real Redis):
who may connect, and that each socket hears its own groups' changes, as the partials' HTML."""

import asyncio

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.sessions.models import Session

from controlplane.accounts import actions as account_actions
from controlplane.accounts.models import Role, User
from controlplane.audit.records import Actor
from controlplane.deployments import instances as instance_actions
from controlplane.deployments.instance_states import InstanceState
from controlplane.fleet import actions as fleet_actions
from controlplane.fleet.models import Node
from controlplane.live import consumers
from controlplane.live.consumers import BAD_REQUEST, FORBIDDEN, NOT_FOUND, NOT_LOGGED_IN, PUSH_ONLY
from controlplane.live.publisher import Publisher
from runtime.fleet_contract.reports import InstanceReport
from tests.controlplane.factories import deploy, make_node, node_report
from tests.controlplane.live_fixtures import (
    communicator,
    connected,
    element,
    live_layer,
    session_cookie,
    two_placed_pipelines,
)

__all__ = ["live_layer"]  # a fixture
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("live_layer")]
RECEIVE_S = 10.0  # generous on a busy machine; each wait ends as soon as the message arrives


async def receive_element(socket: WebsocketCommunicator, element_id: str) -> str:
    """The first message that holds the element ``element_id`` (others, about other rows, are skipped)."""
    while True:
        text = await socket.receive_from(timeout=RECEIVE_S)
        if f'id="{element_id}"' in text:
            return text


async def test_a_socket_without_a_session_is_closed_with_4401() -> None:
    socket = communicator("/ws/fleet/", cookie=None)
    accepted, _ = await socket.connect(timeout=RECEIVE_S)
    assert accepted  # accepted, so that the browser sees why it is closed
    closing = await socket.receive_output(timeout=RECEIVE_S)
    assert closing["type"] == "websocket.close"
    assert closing["code"] == NOT_LOGGED_IN
    await socket.disconnect()  # as the ASGI server tells the consumer after a close


async def test_a_page_of_another_site_cannot_open_a_socket_with_a_persons_session() -> None:
    cookie = await database_sync_to_async(session_cookie)("alice", Role.ADMIN)
    socket = communicator("/ws/fleet/", cookie, origin=(b"origin", b"http://evil.example"))
    accepted, _ = await socket.connect(timeout=RECEIVE_S)
    assert not accepted
    # As the ASGI server tells the refusing consumer after the close; left to the loop's teardown, it hung
    # a CI run's teardown once.
    await socket.disconnect()


async def test_a_read_only_person_watches_the_fleet_and_hears_a_node_register() -> None:
    socket = await connected("/ws/fleet/", Role.READ_ONLY, "reader")
    node = await database_sync_to_async(make_node)("gpu-b")
    text = await receive_element(socket, f"node-{node.pk}")
    assert "gpu-b" in text
    await socket.disconnect()


async def test_a_message_from_the_browser_is_answered_politely_and_changes_nothing() -> None:
    node = await database_sync_to_async(make_node)("gpu-a")
    socket = await connected("/ws/fleet/", Role.READ_ONLY, "reader")
    await socket.send_to(text_data=f'{{"action": "drain", "node": {node.pk}}}')
    assert await socket.receive_from(timeout=RECEIVE_S) == PUSH_ONLY
    refreshed = await database_sync_to_async(Node.objects.get)(pk=node.pk)
    assert not refreshed.draining
    await socket.disconnect()


async def test_a_socket_for_a_pipeline_that_does_not_exist_is_closed_with_4404() -> None:
    cookie = await database_sync_to_async(session_cookie)("alice", Role.OPERATOR)
    socket = communicator("/ws/pipelines/999999/", cookie)
    accepted, _ = await socket.connect(timeout=RECEIVE_S)
    assert accepted
    closing = await socket.receive_output(timeout=RECEIVE_S)
    assert closing["code"] == NOT_FOUND
    await socket.disconnect()  # as the ASGI server tells the consumer after a close


async def test_a_state_change_reaches_its_pipelines_socket_as_the_instance_partial_and_not_the_other() -> None:
    rows = await database_sync_to_async(two_placed_pipelines)()
    on_a = await connected(f"/ws/pipelines/{rows.a.pk}/", username="alice")
    on_b = await connected(f"/ws/pipelines/{rows.b.pk}/", username="bob")

    def report_ready(instance_id: int) -> None:
        instance_actions.report_instance_state(
            Actor.agent("gpu-a"), "gpu-a", instance_id, InstanceReport(state=InstanceState.READY, pid=7)
        )

    await database_sync_to_async(report_ready)(rows.a_instance.pk)
    row_id = f"instance-{rows.a_instance.pk}"
    # The set-up's own notices may come first (the instance pending): the change follows them.
    while "state-ready" not in (element(await receive_element(on_a, row_id), row_id) or ""):
        pass

    # B's socket hears B's change first: A's went to A's group only.
    await database_sync_to_async(report_ready)(rows.b_instance.pk)
    first = await on_b.receive_from(timeout=RECEIVE_S)
    assert f'id="instance-{rows.b_instance.pk}"' in first or f'id="pipeline-{rows.b.pk}"' in first
    assert f"instance-{rows.a_instance.pk}" not in first and f"pipeline-{rows.a.pk}" not in first
    await on_a.disconnect()
    await on_b.disconnect()


async def test_download_progress_of_an_instance_reaches_its_page_though_its_state_does_not_change() -> None:
    rows = await database_sync_to_async(two_placed_pipelines)()
    socket = await connected(f"/ws/pipelines/{rows.a.pk}/")

    def report(progress: float) -> None:
        state = InstanceReport(state=InstanceState.DOWNLOADING, download_progress=progress)
        instance_actions.report_instance_state(Actor.agent("gpu-a"), "gpu-a", rows.a_instance.pk, state)

    await database_sync_to_async(report)(0.1)
    await receive_element(socket, f"instance-{rows.a_instance.pk}")
    await database_sync_to_async(report)(0.42)  # the same state: an .update() with no audit entry
    while "42%" not in (text := await receive_element(socket, f"instance-{rows.a_instance.pk}")):
        pass
    assert 'value="0.42"' in text
    await socket.disconnect()


async def test_a_heartbeat_that_moves_only_gpu_usage_reaches_the_fleet_socket() -> None:
    node = await database_sync_to_async(make_node)("gpu-a", (80,))
    socket = await connected("/ws/fleet/")
    await database_sync_to_async(fleet_actions.heartbeat)(
        Actor.agent("gpu-a"), "gpu-a", node_report((80,), used_gib=33)
    )
    while "33 GiB" not in (text := await receive_element(socket, f"node-{node.pk}")):
        pass
    assert "33 GiB of 80 GiB" in text
    await socket.disconnect()


async def test_a_change_a_socket_did_not_join_for_is_not_sent_to_it(live_layer: Publisher) -> None:
    rows = await database_sync_to_async(two_placed_pipelines)()
    assert await asyncio.to_thread(live_layer.flush, RECEIVE_S)  # the set-up's notices are gone
    socket = await connected(f"/ws/pipelines/{rows.a.pk}/")
    await database_sync_to_async(make_node)("gpu-b")  # the fleet's news, not a pipeline's
    await database_sync_to_async(instance_actions.report_instance_state)(
        Actor.agent("gpu-a"), "gpu-a", rows.a_instance.pk, InstanceReport(state=InstanceState.STARTING)
    )
    # Notices leave in order: the node's, sent first, would come first if this socket heard it.
    first = await socket.receive_from(timeout=RECEIVE_S)
    assert "node-" not in first
    assert f"instance-{rows.a_instance.pk}" in first or f"pipeline-{rows.a.pk}" in first
    await socket.disconnect()


async def test_the_publisher_sent_the_notices_it_was_given(live_layer: Publisher) -> None:
    before = live_layer.sent
    await database_sync_to_async(make_node)("gpu-c")
    assert await database_sync_to_async(live_layer.flush)(RECEIVE_S)
    assert live_layer.sent > before


async def test_a_fleet_page_that_names_its_topics_hears_only_those() -> None:
    nodes_only = await connected("/ws/fleet/?topics=nodes", username="alice")
    everything = await connected("/ws/fleet/", username="bob")
    pipeline = await database_sync_to_async(deploy)("alpha")  # a pipeline row and audit entries, no node
    await receive_element(everything, f"pipeline-{pipeline.pk}")
    node = await database_sync_to_async(make_node)("gpu-b")
    first = await nodes_only.receive_from(timeout=RECEIVE_S)  # the pipeline's news, sent first, went elsewhere
    assert f'id="node-{node.pk}"' in first
    assert "pipeline-" not in first and "audit-" not in first
    await nodes_only.disconnect()
    await everything.disconnect()


async def test_an_unknown_fleet_topic_is_refused_naming_it() -> None:
    cookie = await database_sync_to_async(session_cookie)("alice", Role.OPERATOR)
    socket = communicator("/ws/fleet/?topics=nodes,gpus", cookie)
    accepted, _ = await socket.connect(timeout=RECEIVE_S)
    assert accepted
    closing = await socket.receive_output(timeout=RECEIVE_S)
    assert closing["code"] == BAD_REQUEST
    assert closing["reason"].startswith("topics: gpus unknown")
    await socket.disconnect()  # as the ASGI server tells the consumer after a close


async def test_a_read_only_person_hears_no_audit_entries_as_the_audit_log_refuses_them() -> None:
    reader = await connected("/ws/fleet/", Role.READ_ONLY, "reader")  # every topic it may read
    operator = await connected("/ws/fleet/", Role.OPERATOR, "olive")
    pipeline = await database_sync_to_async(deploy)("alpha")  # a pipeline row and audit entries
    heard_by_operator = await _until_quiet(operator)
    heard_by_reader = await _until_quiet(reader)
    assert f'id="pipeline-{pipeline.pk}"' in heard_by_operator and f'id="pipeline-{pipeline.pk}"' in heard_by_reader
    assert 'id="audit-' in heard_by_operator
    assert 'id="audit-' not in heard_by_reader
    await reader.disconnect()
    await operator.disconnect()


async def test_a_read_only_person_asking_for_the_audit_topic_is_refused_with_4403() -> None:
    cookie = await database_sync_to_async(session_cookie)("reader", Role.READ_ONLY)
    socket = communicator("/ws/fleet/?topics=nodes,audit", cookie)
    accepted, _ = await socket.connect(timeout=RECEIVE_S)
    assert accepted
    closing = await socket.receive_output(timeout=RECEIVE_S)
    assert closing["code"] == FORBIDDEN
    assert "audit needs the operator role" in closing["reason"]
    await socket.disconnect()  # as the ASGI server tells the consumer after a close


async def _until_quiet(socket: WebsocketCommunicator) -> str:
    """Every message of the burst the socket is receiving, joined: the first, then all until 1 s of quiet."""
    texts = [await socket.receive_from(timeout=RECEIVE_S)]
    while not await socket.receive_nothing(timeout=1.0):
        texts.append(await socket.receive_from(timeout=RECEIVE_S))
    return "".join(texts)


async def test_a_socket_first_sends_what_its_page_shows_so_a_change_before_it_joined_is_not_missed() -> None:
    # The page was rendered, then a node registered before its socket joined the group.
    node = await database_sync_to_async(make_node)("gpu-late")
    cookie = await database_sync_to_async(session_cookie)("alice", Role.OPERATOR)
    socket = communicator("/ws/fleet/?topics=nodes", cookie)
    assert (await socket.connect(timeout=RECEIVE_S))[0]
    first = await socket.receive_from(timeout=RECEIVE_S)
    assert 'id="nodes-table"' in first and f'id="node-{node.pk}"' in first
    await socket.disconnect()


async def test_a_pipeline_socket_first_sends_the_pipeline_and_its_instances() -> None:
    rows = await database_sync_to_async(two_placed_pipelines)()
    cookie = await database_sync_to_async(session_cookie)("alice", Role.OPERATOR)
    socket = communicator(f"/ws/pipelines/{rows.a.pk}/", cookie)
    assert (await socket.connect(timeout=RECEIVE_S))[0]
    first = await socket.receive_from(timeout=RECEIVE_S)
    assert f'id="pipeline-{rows.a.pk}"' in first and f'id="instance-{rows.a_instance.pk}"' in first
    assert f'id="instance-{rows.b_instance.pk}"' not in first
    await socket.disconnect()


def _change_person(username: str, **fields: object) -> None:
    User.objects.filter(username=username).update(**fields)


async def _closing(socket: WebsocketCommunicator) -> dict[str, object]:
    """The socket's close message (pushes before it are skipped), after which the consumer is told the
    socket is gone and ended, as the ASGI server does."""
    while True:
        output = await socket.receive_output(timeout=RECEIVE_S)
        if output["type"] == "websocket.close":
            await socket.disconnect()
            return output


@pytest.fixture
def quick_reauthorisation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(consumers, "REAUTHORISE_S", 0.2)


@pytest.mark.usefixtures("quick_reauthorisation")
async def test_a_socket_of_a_person_deactivated_meanwhile_is_closed_with_4403() -> None:
    socket = await connected(f"/ws/pipelines/{await _a_pipeline()}/", Role.OPERATOR, "alice")
    await database_sync_to_async(_change_person)("alice", is_active=False)
    closing = await _closing(socket)
    assert closing["code"] == FORBIDDEN
    assert "deactivated" in str(closing["reason"])


@pytest.mark.usefixtures("quick_reauthorisation")
async def test_a_person_demoted_below_the_audit_role_loses_the_fleet_socket_that_hears_the_audit_log() -> None:
    fleet = await connected("/ws/fleet/", Role.OPERATOR, "alice")
    nodes_only = await connected("/ws/fleet/?topics=nodes", Role.OPERATOR, "bob")
    await database_sync_to_async(_change_person)("alice", role=Role.READ_ONLY)
    await database_sync_to_async(_change_person)("bob", role=Role.READ_ONLY)
    closing = await _closing(fleet)
    assert closing["code"] == FORBIDDEN
    assert "operator role" in str(closing["reason"])
    # Read-only people may still watch the nodes: that socket hears on.
    node = await database_sync_to_async(make_node)("gpu-c")
    assert "gpu-c" in await receive_element(nodes_only, f"node-{node.pk}")
    await nodes_only.disconnect()


@pytest.mark.usefixtures("quick_reauthorisation")
async def test_a_socket_whose_session_ended_is_closed_with_4401() -> None:
    socket = await connected("/ws/fleet/?topics=nodes", Role.READ_ONLY, "alice")
    await database_sync_to_async(lambda: Session.objects.all().delete())()  # a logout
    closing = await _closing(socket)
    assert closing["code"] == NOT_LOGGED_IN


@pytest.mark.usefixtures("quick_reauthorisation")
async def test_a_deactivation_or_a_password_reset_on_the_people_page_closes_the_persons_sockets() -> None:
    """The People page's actions, not only a changed row: a deactivation is a 4403, a reset a 4401."""
    deactivated = await connected("/ws/fleet/?topics=nodes", Role.READ_ONLY, "alice")
    reset = await connected("/ws/fleet/?topics=nodes", Role.READ_ONLY, "bob")

    def act() -> None:
        admin = Actor("boss", user_id=None)
        account_actions.deactivate_user(admin, User.objects.get(username="alice"))
        account_actions.reset_password(admin, User.objects.get(username="bob"))

    await database_sync_to_async(act)()
    assert (await _closing(deactivated))["code"] == FORBIDDEN
    assert (await _closing(reset))["code"] == NOT_LOGGED_IN


async def test_a_push_after_a_deactivation_is_not_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    socket = await connected("/ws/fleet/?topics=nodes", Role.READ_ONLY, "alice")
    await database_sync_to_async(_change_person)("alice", is_active=False)
    monkeypatch.setattr(consumers, "REAUTHORISE_S", 0.0)  # the next push checks again
    await database_sync_to_async(make_node)("gpu-d")
    closing = await socket.receive_output(timeout=RECEIVE_S)
    assert (closing["type"], closing["code"]) == ("websocket.close", FORBIDDEN)
    await socket.disconnect()  # as the ASGI server tells the consumer after a close


async def _a_pipeline() -> int:
    return (await database_sync_to_async(deploy)("watched")).pk


async def test_a_socket_is_authorised_again_before_it_rejoins_its_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(consumers, "REAUTHORISE_S", 3600.0)  # only the rejoin checks in this test
    monkeypatch.setattr(consumers, "GROUP_REFRESH_S", 0.2)
    socket = await connected("/ws/fleet/?topics=nodes", Role.READ_ONLY, "alice")
    await database_sync_to_async(_change_person)("alice", is_active=False)
    closing = await _closing(socket)
    assert closing["code"] == FORBIDDEN
