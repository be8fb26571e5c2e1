"""The ASGI guard that reads each request's body whole, within a deadline and a size limit, before the app runs."""

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import uvicorn
from asgiref.wsgi import WsgiToAsgi
from django.core.handlers.wsgi import WSGIRequest
from rest_framework.test import APIClient

from controlplane.body_limit import limit_body
from tests.servers import free_port, read_until_closed


async def call(
    headers: list[tuple[bytes, bytes]], scope_type: str = "http", body: list[bytes] | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """What the guard sends, and what the app received of the body (None: the app was not reached).

    ``body`` is what the client sends, piece by piece; None: the guard must not read it."""
    sent: list[dict[str, Any]] = []
    received: list[dict[str, Any]] | None = None
    pieces = list(body or [])

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal received
        received = [await receive()] if body is not None else []

    async def receive() -> dict[str, Any]:
        if body is None:
            raise AssertionError("the guard must not read the body")
        piece = pieces.pop(0)
        return {"type": "http.request", "body": piece, "more_body": bool(pieces)}

    async def send(message: Any) -> None:
        sent.append(message)

    await limit_body(app, 100)({"type": scope_type, "headers": headers}, receive, send)
    return sent, received


async def test_a_body_declared_over_the_limit_is_refused_unread() -> None:
    sent, received = await call([(b"content-length", b"101")])
    assert received is None
    assert sent[0]["status"] == 413
    assert json.loads(sent[1]["body"]) == {"detail": "the request body is over the limit of 100 bytes"}


async def test_requests_without_a_body_pass_unread() -> None:
    for headers in ([], [(b"content-length", b"0")], [(b"content-length", b"garbage")]):
        sent, received = await call(headers)
        assert received == [] and sent == [], headers


async def test_a_body_within_the_limit_reaches_the_app_read_whole() -> None:
    sent, received = await call([(b"content-length", b"100")], body=[b"x" * 40, b"y" * 60])
    assert sent == []
    assert received == [{"type": "http.request", "body": b"x" * 40 + b"y" * 60, "more_body": False}]


async def test_a_body_longer_than_declared_and_over_the_limit_is_a_413() -> None:
    sent, received = await call([(b"content-length", b"50")], body=[b"x" * 60, b"y" * 60])
    assert received is None
    assert sent[0]["status"] == 413


async def test_a_body_that_does_not_arrive_in_time_is_a_408_and_the_app_is_not_reached() -> None:
    sent: list[dict[str, Any]] = []
    reached = False

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal reached
        reached = True

    async def never() -> dict[str, Any]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "headers": [(b"content-length", b"10")]}
    await limit_body(app, 100, timeout_s=0.05)(scope, never, send)
    assert not reached
    assert sent[0]["status"] == 408
    assert (b"connection", b"close") in sent[0]["headers"]
    assert json.loads(sent[1]["body"]) == {"detail": "the request body did not arrive within 0.05 s"}


async def test_a_request_without_a_body_whose_client_left_before_it_ran_reaches_django_whole() -> None:
    """A fuzzer's client that gives up while its bodiless request waits for a request thread: by the time the
    app asks for the body, the server's receive says ``http.disconnect``. Django's WSGI wrapper raised
    "WSGI wrapper received a non-HTTP-request message" on it (an ASGI error per such request)."""
    sent: list[dict[str, Any]] = []
    ran: list[str] = []

    def wsgi_app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        ran.append(environ["REQUEST_METHOD"])
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "http_version": "1.1",
        "method": "POST",
        "path": "/api/v1/pipelines/1/stop/",
        "headers": [],
        "query_string": b"",
    }
    await limit_body(WsgiToAsgi(wsgi_app), 100)(scope, receive, send)
    assert ran == ["POST"]
    assert sent[0]["status"] == 200


async def test_websockets_pass_untouched() -> None:
    _, received = await call([(b"content-length", b"1000")], scope_type="websocket")
    assert received == []


# -- chunked bodies, through a real uvicorn server --------------------------------------------------------


@contextmanager
def serving(app: Any, *, timeout_s: float = 10.0) -> Iterator[str]:
    """``app`` behind the guard on a real uvicorn server in a thread; yields its base URL."""
    port = free_port()
    guarded = limit_body(app, 100, timeout_s=timeout_s)
    server = uvicorn.Server(uvicorn.Config(guarded, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def django_echo(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    """What Django's request reads of the body (the control plane's views run under WSGI, controlplane/asgi.py)."""
    body = WSGIRequest(environ).body
    start_response("200 OK", [("Content-Type", "application/octet-stream")])
    return [body]


def chunks(*parts: bytes) -> Iterator[bytes]:
    yield from parts  # a generator: httpx sends it with Transfer-Encoding: chunked, without a length


def test_a_chunked_json_body_reaches_django_whole() -> None:
    document = json.dumps({"replicas": 3}).encode()
    with serving(WsgiToAsgi(django_echo)) as url:
        response = httpx.post(
            url, content=chunks(document[:5], document[5:]), headers={"content-type": "application/json"}
        )
    assert response.request.headers["transfer-encoding"] == "chunked"
    assert (response.status_code, response.content) == (200, document)


def test_a_chunked_body_over_the_limit_is_a_413() -> None:
    with serving(WsgiToAsgi(django_echo)) as url:
        response = httpx.post(url, content=chunks(b"x" * 60, b"y" * 60))
    assert response.status_code == 413
    assert response.json() == {"detail": "the request body is over the limit of 100 bytes"}


@pytest.mark.django_db(transaction=True)  # the server's threads see the token
def test_a_chunked_post_to_the_api_is_read_as_its_json(admin: APIClient) -> None:
    # Read as empty, the body was a 400 for every field; read whole, the name it gives is no longer missing.
    from controlplane.asgi import application

    token = admin._credentials["HTTP_AUTHORIZATION"]  # type: ignore[attr-defined]
    with serving(application) as url:
        response = httpx.post(
            f"{url}/api/v1/models/",
            content=chunks(b'{"name": ', b'"chunked"}'),
            headers={"content-type": "application/json", "authorization": token},
        )
    assert response.status_code == 400, response.text
    assert "source" in response.text and "name" not in response.json(), response.text


def test_a_client_that_sends_headers_and_then_too_little_body_gets_a_408_at_the_deadline() -> None:
    with serving(WsgiToAsgi(django_echo), timeout_s=0.5) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            client.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n" + b"x" * 10)
            started = time.monotonic()
            answer = read_until_closed(client)
            waited = time.monotonic() - started
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), answer
    assert json.loads(body) == {"detail": "the request body did not arrive within 0.5 s"}
    assert 0.4 < waited < 3
