"""The control plane's own server process, started as `flotilla up`, the systemd unit and the tests start it
(uvicorn): each request's headers are held to a deadline (controlplane/http_protocol.py), and a request that
fails leaves its traceback in the process's log (controlplane/logging_config.py)."""

import json
import select
import socket
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.agent.control_plane_server import ControlPlaneServer
from tests.servers import read_until_closed

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlaneServer]:
    server = ControlPlaneServer(Path(tmp_path_factory.mktemp("head_deadline")), broker_url="redis://127.0.0.1:1/0")
    server.env["FLOTILLA_API_HEADER_TIMEOUT_S"] = "1"
    server.start()
    yield server
    server.stop()


def connect(server: ControlPlaneServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(10)
    return sock


def test_headers_trickled_past_the_deadline_get_a_408_in_the_apis_shape_and_the_connection_closed(
    control_plane: ControlPlaneServer,
) -> None:
    with connect(control_plane) as sock:
        sock.sendall(b"GET /api/v1/models/ HTTP/1.1\r\nHost: test\r\nX-Slow: ")
        started = time.monotonic()
        while not select.select([sock], [], [], 0.1)[0]:  # a byte every 0.1 s: the head never ends
            sock.sendall(b"x")
            assert time.monotonic() - started < 10, "no answer to trickled headers"
        head, _, body = read_until_closed(sock).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ")
    assert json.loads(body) == {"detail": "the request's headers did not arrive within 1 s; the connection is closed"}
    assert "its request headers did not arrive within 1 s (FLOTILLA_API_HEADER_TIMEOUT_S)" in control_plane.log()


def test_a_silent_connection_is_closed_and_requests_in_time_are_served(control_plane: ControlPlaneServer) -> None:
    with connect(control_plane) as sock:
        assert read_until_closed(sock) == b""
    assert httpx.get(control_plane.url + "/api/v1/models/", timeout=10).status_code == 401  # Django answered


def test_a_request_that_fails_leaves_its_traceback_in_the_log(
    control_plane: ControlPlaneServer, tmp_path: Path
) -> None:
    # A copy of the module's database, then a table dropped under it: every list of models now fails (a 500).
    broken = ControlPlaneServer(
        tmp_path / "broken", broker_url="redis://127.0.0.1:1/0", template=control_plane.database
    )
    token = broken.person_token("olga", "operator")
    with sqlite3.connect(broken.database) as database:
        database.execute("DROP TABLE catalog_languagemodel")
    broken.start()
    try:
        with broken.client(token) as client:
            assert client.get("/api/v1/models/").status_code == 500
        log = broken.log()
    finally:
        broken.stop()
    # With DEBUG off (the default), Django's own logging kept this from every handler.
    assert "ERROR django.request: Internal Server Error: /api/v1/models/" in log
    assert "Traceback (most recent call last)" in log and "no such table: catalog_languagemodel" in log
