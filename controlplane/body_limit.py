"""Refuse a request whose declared body is over the API's limit before anything reads it.

Django's ASGI handler reads the whole body before the view runs, and answers a body over
DATA_UPLOAD_MAX_MEMORY_SIZE with an HTML 400; this guard answers the common case (a Content-Length
over the limit) at once with the API's JSON 413. A chunked body without a length still meets the API
parser's own limit.
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

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _declared_length(scope) > max_bytes:
            await send(
                {
                    "type": "http.response.start",
                    "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
                }
            )
            await send({"type": "http.response.body", "body": refusal})
            return
        await app(scope, receive, send)

    return guarded


def _declared_length(scope: Scope) -> int:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0
