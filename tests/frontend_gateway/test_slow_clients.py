"""Clients too slow to serve, over real sockets to a real server: one that stalls or trickles its request
body gets a 408 at the body deadline and its connection closed; one that stops reading its stream is
dropped at the send deadline, its connection aborted, its generation stopped and its slot freed (under
another ASGI server, whose connection the app cannot reach, the request is cancelled instead)."""

import asyncio
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from frontend_gateway.admission import AdmissionLimits
from frontend_gateway.http_app import GatewayApp
from frontend_gateway.models.pipeline import ModelRegistry, TokenModel
from runtime.models.loading import load_model_card
from tests.distributed.cluster import wait_until
from tests.frontend_gateway.asgi import Client, TokenScript, call
from tests.frontend_gateway.test_health_and_metrics import metric_value
from tests.servers import Server, start_server

DEADLINE_S = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("slow_clients") / "server.log"
    deadlines = [
        "--header-timeout",
        str(DEADLINE_S),
        "--body-timeout",
        str(DEADLINE_S),
        "--send-timeout",
        str(DEADLINE_S),
    ]
    # One slot: a request that held it after its client was dropped would keep the next one waiting.
    args = ["out=echo_full", "--model-name", "echo", "--max-inflight", "1", *deadlines]
    started = start_server(args, log, env={"FLOTILLA_TOKEN_ECHO_DELAY_MS": "0"})
    yield started
    started.stop()


def connect(server: Server, receive_buffer: int | None = None) -> socket.socket:
    host, port = server.base_url.removeprefix("http://").split(":")
    sock = socket.socket()
    if receive_buffer is not None:  # before connecting: it sets the window the server may fill
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect((host, int(port)))
    return sock


def request_head(length: int) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % length
    )


def read_to_end(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """What the server sends until it closes the connection (a reset counts as closed); fails if it
    keeps the connection open ``timeout`` s after its last byte."""
    sock.settimeout(timeout)
    received = bytearray()
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"the server kept the connection open; it sent {bytes(received[:300])!r}") from None
    return bytes(received)


def metrics(server: Server) -> str:
    return httpx.get(server.base_url + "/metrics", timeout=5).text


def dropped(server: Server, reason: str) -> float:
    return metric_value(metrics(server), "flotilla_frontend_slow_clients_dropped_total", reason=reason)


def assert_408(response: bytes) -> None:
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), response[:300]
    assert b"connection: close" in head.lower()
    # The body is chunked (uvicorn's choice for an answer without Content-Length): its one chunk is the error.
    error = msgspec.json.decode(body.split(b"\r\n")[1])["error"]
    assert error["code"] == "request_timeout" and "did not arrive within 1 s" in error["message"]


def test_a_client_that_stalls_its_body_gets_a_408_at_the_deadline_and_its_connection_closed(server: Server) -> None:
    before = dropped(server, "body")
    with connect(server) as sock:
        sock.sendall(request_head(1000) + b'{"model": "echo", ')  # and nothing more
        assert_408(read_to_end(sock))
    assert dropped(server, "body") == before + 1
    # Nothing of it is left holding the one slot.
    answer = httpx.post(server.api_url + "/chat/completions", json=chat("hi"), timeout=10)
    assert answer.status_code == 200


def test_a_client_that_trickles_its_body_gets_a_408_at_the_deadline_too(server: Server) -> None:
    with connect(server) as sock:
        sock.sendall(request_head(10_000))
        started = time.monotonic()
        # A byte every 0.1 s: each arrives well within the deadline, the body never does.
        while not select.select([sock], [], [], 0.1)[0]:
            sock.sendall(b" ")
            assert time.monotonic() - started < 10, "no answer to a trickled body"
        assert_408(read_to_end(sock))


def trickle_until_answered(sock: socket.socket, byte: bytes = b"x") -> bytes:
    """Send ``byte`` every 0.1 s (each well within the deadline) until the server answers or closes."""
    started = time.monotonic()
    while not select.select([sock], [], [], 0.1)[0]:
        sock.sendall(byte)
        assert time.monotonic() - started < 10, "no answer to a trickled request"
    return read_to_end(sock)


def read_response(sock: socket.socket) -> bytes:
    """One whole chunked response (as uvicorn sends the app's answers), and not a byte more."""
    sock.settimeout(10)
    received = b""
    while not received.endswith(b"\r\n0\r\n\r\n"):
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed after {received[:300]!r}"
        received += chunk
    assert b"transfer-encoding: chunked" in received.partition(b"\r\n\r\n")[0].lower()
    return received


def assert_head_408(response: bytes) -> None:
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), response[:300]
    assert b"connection: close" in head.lower()
    error = msgspec.json.decode(body)["error"]
    assert error["code"] == "request_timeout"
    assert error["message"] == "the request's headers did not arrive within 1 s; the connection is closed"


def test_a_client_that_trickles_its_headers_gets_a_408_at_the_deadline_and_its_connection_closed(
    server: Server,
) -> None:
    before = dropped(server, "head")
    with connect(server) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nX-Slow: ")
        assert_head_408(trickle_until_answered(sock))
    assert dropped(server, "head") == before + 1


def test_a_connection_that_sends_nothing_is_closed_at_the_deadline_without_a_word(server: Server) -> None:
    before = dropped(server, "head")
    with connect(server) as sock:
        started = time.monotonic()
        assert read_to_end(sock) == b""
        assert time.monotonic() - started >= DEADLINE_S * 0.9
    assert dropped(server, "head") == before + 1


def test_each_request_on_a_kept_alive_connection_has_a_head_deadline_of_its_own(server: Server) -> None:
    body = msgspec.json.encode(chat("hi"))
    with connect(server) as sock:
        # A first request, whole and answered, on a connection older than the deadline by the time it ends...
        time.sleep(DEADLINE_S * 0.6)
        sock.sendall(request_head(len(body)) + body)
        time.sleep(DEADLINE_S * 0.6)
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")
        # ...then a second one whose headers trickle: its deadline runs from its own first byte.
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: test\r\nX-Slow: ")
        assert_head_408(trickle_until_answered(sock))


def chat(content: str, stream: bool = False) -> dict[str, object]:
    return {"model": "echo", "messages": [{"role": "user", "content": content}], "stream": stream}


def test_a_client_that_stops_reading_its_stream_is_dropped_and_its_generation_and_slot_are_freed(
    server: Server,
) -> None:
    before = metrics(server)
    # echo_full streams the 200,000 characters back one event (~150 bytes) each: some 30 MB, far more
    # than the socket buffers hold, so the server's sends wait once the client stops reading.
    body = msgspec.json.encode(chat("x" * 200_000, stream=True))
    with connect(server, receive_buffer=4096) as sock:
        sock.sendall(request_head(len(body)) + body)
        head = sock.recv(1024)  # the stream started; from now on this client reads nothing
        assert head.startswith(b"HTTP/1.1 200 "), head
        wait_until(lambda: dropped(server, "send") == 1, 30, "the client that stopped reading was never dropped")

        after = metrics(server)
        cancelled = {"model": "echo", "endpoint": "chat_completions", "request_type": "stream", "status": "cancelled"}
        assert metric_value(after, "flotilla_frontend_requests_total", **cancelled) == (
            metric_value(before, "flotilla_frontend_requests_total", **cancelled) + 1
        )
        produced = metric_value(after, "flotilla_frontend_output_tokens_total", model="echo") - metric_value(
            before, "flotilla_frontend_output_tokens_total", model="echo"
        )
        assert 0 < produced < 100_000, f"the generation went on after the drop: {produced} tokens"
        assert metric_value(after, "flotilla_frontend_inflight_requests", model="echo") == 0
        # Its slot is free (there is one): the next request is served at once, not queued behind it.
        answer = httpx.post(server.api_url + "/chat/completions", json=chat("hi"), timeout=10)
        assert answer.status_code == 200
        assert answer.json()["choices"][0]["message"]["content"] == "hi"
        # And its connection is gone, not left open with the unread bytes.
        read_to_end(sock)
    assert "Traceback" not in server.log() and "ASGI callable" not in server.log()
    assert "dropped 127.0.0.1:" in server.log() and "took none of its response for 1 s" in server.log()


async def test_under_a_server_whose_connection_it_cannot_reach_a_stalled_send_cancels_the_request(
    smollm2: Path,
) -> None:
    card = load_model_card(smollm2)
    engine = TokenScript([11, 12], endless=True)
    registry = ModelRegistry()
    registry.add(TokenModel(card, engine))
    app = GatewayApp(registry, send_timeout_s=0.2, limits=AdmissionLimits(max_inflight=1))
    body = {"model": card.name, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    never = asyncio.Event()

    class Stalled(Client):  # takes the status line and the first event, then nothing: every send waits
        async def send(self, message: dict[str, object]) -> None:
            await super().send(message)
            if len(self.sent) >= 2:
                await never.wait()

    stalled = Stalled(msgspec.json.encode(body))
    async with asyncio.timeout(10):  # the request returns once dropped, far sooner
        await call(app, "/v1/chat/completions", None, stalled)
    await engine.closed.wait()  # the generation was closed, not left to the garbage collector
    assert app.admission.inflight == 0
    exposition = app.metrics.exposition().decode()
    assert metric_value(exposition, "flotilla_frontend_slow_clients_dropped_total", reason="send") == 1
