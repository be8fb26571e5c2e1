"""The ASGI guard that refuses bodies declared over the limit before anything reads them."""

import json
from typing import Any

from controlplane.body_limit import limit_body


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
