"""Refuse a request whose declared body is over the API's limit before anything reads it, and give a
chunked body the length Django needs.

Django's ASGI handler reads the whole body before the view runs, and answers a body over
DATA_UPLOAD_MAX_MEMORY_SIZE with an HTML 400; this guard answers the common case (a Content-Length
over the limit) at once with the API's JSON 413.

A body sent with ``Transfer-Encoding: chunked`` has no Content-Length, and Django under WSGI (how the
control plane runs its views: controlplane/asgi.py) reads only ``CONTENT_LENGTH`` bytes: none, so a
chunked JSON POST arrived empty. The guard reads such a body here, up to the same limit (413 past it),
and hands it on with its Content-Length.
"""

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def limit_body(app: ASGIApp, max_bytes: int) -> ASGIApp:
    """Wrap ``app`` so that HTTP requests declaring more than ``max_bytes`` get a 413 without being read."""
    refusal = json.dumps({"detail": f"the request body is over the limit of {max_bytes} bytes"}).encode()

    async def refuse(send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
            }
        )
        await send({"type": "http.response.body", "body": refusal})

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        length = _declared_length(scope)
        if length is not None and length > max_bytes:
            await refuse(send)
            return
        if length is None and _chunked(scope):
            body = bytearray()
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                body += message.get("body", b"")
                if len(body) > max_bytes:
                    await refuse(send)
                    return
                if not message.get("more_body", False):
                    break
            scope, receive = _with_body(scope, receive, bytes(body))
        await app(scope, receive, send)

    return guarded


def _declared_length(scope: Scope) -> int | None:
    """The Content-Length (0 when it is not a number); None when there is none."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else 0
    return None


def _chunked(scope: Scope) -> bool:
    return any(name == b"transfer-encoding" and b"chunked" in value.lower() for name, value in scope.get("headers", ()))


def _with_body(scope: Scope, receive: Receive, body: bytes) -> tuple[Scope, Receive]:
    """The scope with a Content-Length instead of its Transfer-Encoding, and a receive that gives ``body`` first."""
    headers = [(name, value) for name, value in scope["headers"] if name != b"transfer-encoding"]
    headers.append((b"content-length", str(len(body)).encode()))
    given = False

    async def replay() -> MutableMapping[str, Any]:
        nonlocal given
        if given:
            return await receive()  # what follows the body: the client's disconnect
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return {**scope, "headers": headers}, replay
