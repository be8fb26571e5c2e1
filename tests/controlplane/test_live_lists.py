"""Rows that appear and disappear without a reload (Channels' WebsocketCommunicator, the Redis channel layer
on a real Redis): a created or deleted row comes as its whole list, a changed row comes alone, and each
fleet page's socket names the topics the page shows."""

import asyncio
import re

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client

from controlplane.accounts.models import Role
from controlplane.audit.records import Actor
from controlplane.deployments import evacuation
from controlplane.deployments.models import Pipeline
from controlplane.deployments.pipelines import delete_pipeline, stop_pipeline
from controlplane.fleet import actions as fleet_actions
from controlplane.fleet.models import Download
from controlplane.live.publisher import Publisher
from runtime.fleet_contract.reports import DownloadReport
from tests.controlplane.factories import TEST_ACTOR, deploy, make_model, make_node, make_user, node_report
from tests.controlplane.live_fixtures import caught_up, communicator, connected, element, live_layer

__all__ = ["live_layer"]  # a fixture
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("live_layer")]
RECEIVE_S = 10.0  # generous on a busy machine; each wait ends as soon as the message arrives


async def receive_element(socket: WebsocketCommunicator, element_id: str) -> str:
    """The element ``element_id`` of the first message that holds it (messages about others are skipped)."""
    while True:
        found = element(await socket.receive_from(timeout=RECEIVE_S), element_id)
        if found is not None:
            return found


async def settled(publisher: Publisher) -> None:
    """Every notice of the set-up has left, before a socket joins (so that it hears only what follows)."""
    assert await asyncio.to_thread(publisher.flush, RECEIVE_S)


async def test_a_node_registered_while_a_socket_listens_arrives_inside_the_node_table() -> None:
    await database_sync_to_async(make_node)("gpu-a")
    socket = await connected("/ws/fleet/?topics=nodes")
    node = await database_sync_to_async(make_node)("gpu-b", (80,))
    table = await receive_element(socket, "nodes-table")
    assert f'id="node-{node.pk}"' in table and "gpu-b" in table
    assert "gpu-a" in table  # the list, not the new row alone
    await socket.disconnect()


async def test_a_deleted_pipeline_is_gone_from_the_table_that_follows(live_layer: Publisher) -> None:
    def two_pipelines_one_stopped() -> tuple[Pipeline, Pipeline]:
        kept, doomed = deploy("alpha"), deploy("beta")
        return kept, stop_pipeline(TEST_ACTOR, doomed)

    kept, doomed = await database_sync_to_async(two_pipelines_one_stopped)()
    await settled(live_layer)
    socket = await connected("/ws/fleet/?topics=pipelines")
    await database_sync_to_async(delete_pipeline)(TEST_ACTOR, doomed)
    table = await receive_element(socket, "pipelines-table")
    assert f'id="pipeline-{doomed.pk}"' not in table and "beta" not in table
    assert f'id="pipeline-{kept.pk}"' in table
    await socket.disconnect()


async def test_the_last_node_deleted_leaves_the_empty_state() -> None:
    node = await database_sync_to_async(make_node)("gpu-a")
    socket = await connected("/ws/fleet/?topics=nodes")
    await database_sync_to_async(evacuation.delete_node)(TEST_ACTOR, node)
    while "No nodes yet" not in (table := await receive_element(socket, "nodes-table")):
        pass
    assert f"node-{node.pk}" not in table
    await socket.disconnect()


async def test_a_heartbeat_pushes_the_nodes_row_alone(live_layer: Publisher) -> None:
    node = await database_sync_to_async(make_node)("gpu-a", (80,))
    await settled(live_layer)
    socket = await connected("/ws/fleet/?topics=nodes")
    await database_sync_to_async(fleet_actions.heartbeat)(
        Actor.agent("gpu-a"), "gpu-a", node_report((80,), used_gib=33)
    )
    first = await socket.receive_from(timeout=RECEIVE_S)
    assert first.lstrip().startswith(f'<div id="node-{node.pk}" class="tr"')
    assert "nodes-table" not in first
    await socket.disconnect()


async def test_the_models_page_hears_a_new_model_and_a_new_download_as_their_tables(live_layer: Publisher) -> None:
    await database_sync_to_async(make_node)("gpu-a")
    await settled(live_layer)
    socket = await connected("/ws/fleet/?topics=models,downloads")
    model = await database_sync_to_async(make_model)("smol")
    catalog = await receive_element(socket, "models-table")
    assert f'id="model-{model.pk}"' in catalog and "smol" in catalog

    def download_starts() -> Download:
        report = DownloadReport(state="downloading", bytes_done=1 << 30, bytes_total=4 << 30)
        return fleet_actions.report_download(Actor.agent("gpu-a"), "gpu-a", model.pk, report)

    download = await database_sync_to_async(download_starts)()
    downloads = await receive_element(socket, "downloads-table")
    assert f'id="download-{download.pk}"' in downloads and "1 GiB of 4 GiB" in downloads
    await socket.disconnect()


async def test_a_deployed_pipeline_moves_the_catalogs_count_of_pipelines(live_layer: Publisher) -> None:
    model = await database_sync_to_async(make_model)("smol")
    await settled(live_layer)
    socket = await connected("/ws/fleet/?topics=models")
    await database_sync_to_async(deploy)("alpha", model)
    row = element(await receive_element(socket, "models-table"), f"model-{model.pk}")
    assert row is not None
    assert re.findall(r"<td>([^<]*)</td>", row)[-1] == "1"  # the last column: pipelines deployed from it
    await socket.disconnect()


def fleet_pages_socket_paths() -> tuple[bytes, dict[str, str]]:
    """An operator's session cookie, and the socket path each fleet page connects to (sync)."""
    client = Client()
    client.force_login(make_user("olga", Role.OPERATOR))
    paths = {}
    for page in ("/", "/nodes/", "/pipelines/", "/models/"):
        match = re.search(r'ws-connect="([^"]+)"', client.get(page).content.decode())
        assert match, page
        paths[page] = match.group(1)
    return f"sessionid={client.cookies['sessionid'].value}".encode(), paths


async def test_each_fleet_pages_socket_hears_the_lists_it_shows_and_not_the_others() -> None:
    cookie, paths = await database_sync_to_async(fleet_pages_socket_paths)()
    sockets = {page: communicator(path, cookie) for page, path in paths.items()}
    for socket in sockets.values():
        assert (await socket.connect(timeout=RECEIVE_S))[0]
        await caught_up(socket)

    await database_sync_to_async(deploy)("alpha")  # a pipeline, its model and audit entries; no node
    for page in ("/", "/pipelines/"):
        assert "alpha" in await receive_element(sockets[page], "pipelines-table"), page
    assert "alpha-model" in await receive_element(sockets["/models/"], "models-table")

    await database_sync_to_async(make_node)("gpu-b")
    assert "gpu-b" in await receive_element(sockets["/"], "nodes-table")
    # The node's news is the first the nodes page hears: the pipeline's, sent before, went elsewhere.
    first = await sockets["/nodes/"].receive_from(timeout=RECEIVE_S)
    assert 'id="nodes-table"' in first and "pipeline" not in first and "audit-" not in first
    for socket in sockets.values():
        await socket.disconnect()
