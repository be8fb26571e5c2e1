"""The ASGI guard that refuses bodies declared over the limit before anything reads them."""

import json
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
from tests.servers import free_port


async def call(headers: list[tuple[bytes, bytes]], scope_type: str = "http") -> tuple[list[dict[str, Any]], bool]:
    sent: list[dict[str, Any]] = []
    reached = False

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal reached
        reached = True

    async def receive() -> dict[str, Any]:
        raise AssertionError("the guard must not read the body")

    async def send(message: Any) -> None:
        sent.append(message)

    await limit_body(app, 100)({"type": scope_type, "headers": headers}, receive, send)
    return sent, reached


async def test_a_body_declared_over_the_limit_is_refused_unread() -> None:
    sent, reached = await call([(b"content-length", b"101")])
    assert not reached
    assert sent[0]["status"] == 413
    assert json.loads(sent[1]["body"]) == {"detail": "the request body is over the limit of 100 bytes"}


async def test_bodies_within_the_limit_or_without_a_length_pass() -> None:
    for headers in ([(b"content-length", b"100")], [], [(b"content-length", b"garbage")]):
        sent, reached = await call(headers)
        assert reached and sent == [], headers


async def test_websockets_pass_untouched() -> None:
    _, reached = await call([(b"content-length", b"1000")], scope_type="websocket")
    assert reached


# -- chunked bodies, through a real uvicorn server --------------------------------------------------------


@contextmanager
def serving(app: Any) -> Iterator[str]:
    """``app`` behind the guard on a real uvicorn server in a thread; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(limit_body(app, 100), host="127.0.0.1", port=port, log_level="warning"))
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
