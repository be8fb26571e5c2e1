"""Controls a person may not use are left out of the HTML, on pages and in live pushes alike (not hidden by CSS:
a read-only person's page has no scale, stop, start, restart, cordon, drain or planner form in it at all)."""

import re

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator

from controlplane.accounts.models import Role
from tests.controlplane.factories import make_node
from tests.controlplane.live_fixtures import communicator, live_layer, session_cookie, two_placed_pipelines
from tests.controlplane.test_dashboard import a_small_fleet, logged_in

__all__ = ["live_layer"]  # a fixture
RECEIVE_S = 10.0  # generous on a busy machine; each wait ends as soon as the message arrives
# What a control looks like in the HTML: an htmx POST (the logout form is a plain POST form, not a control).
CONTROL = re.compile(r'hx-post="[^"]*/(scale|stop|start|restart|planner|drain|undrain|cordon|uncordon)/"')


@pytest.mark.django_db
@pytest.mark.parametrize("page", ["/", "/pipelines/", "/pipelines/{pipeline}/", "/nodes/"])
def test_a_read_only_persons_pages_have_no_controls_in_their_html_and_an_operators_have_them(page: str) -> None:
    ids = a_small_fleet()
    path = page.format(**ids)
    reader = logged_in(Role.READ_ONLY).get(path).content.decode()
    operator = logged_in(Role.OPERATOR).get(path).content.decode()
    assert CONTROL.search(operator), f"an operator's {path} has no control"
    assert not CONTROL.search(reader), f"{path} of a read-only person has {CONTROL.findall(reader)}"
    assert "Save planner settings" not in reader


async def _first_push(path: str, role: Role, username: str) -> str:
    cookie = await database_sync_to_async(session_cookie)(username, role)
    socket: WebsocketCommunicator = communicator(path, cookie)
    assert (await socket.connect(timeout=RECEIVE_S))[0]
    try:
        return await socket.receive_from(timeout=RECEIVE_S)
    finally:
        await socket.disconnect()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("live_layer")
async def test_a_read_only_persons_socket_pushes_rows_without_controls_and_an_operators_with_them() -> None:
    rows = await database_sync_to_async(two_placed_pipelines)()
    await database_sync_to_async(make_node)("gpu-b")
    for number, path in enumerate((f"/ws/pipelines/{rows.a.pk}/", "/ws/fleet/?topics=nodes,pipelines")):
        reader = await _first_push(path, Role.READ_ONLY, f"rita-{number}")
        operator = await _first_push(path, Role.OPERATOR, f"olive-{number}")
        assert CONTROL.search(operator), f"an operator's {path} push has no control"
        assert not CONTROL.search(reader), f"a read-only person's {path} push has {CONTROL.findall(reader)}"
