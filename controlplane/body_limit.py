"""Read each HTTP request's body whole, within a deadline and a size limit, before anything else runs.

The control plane runs Django's views on a few request threads (controlplane/request_threads.py). Had a
request taken its thread first and read its body there, a client that sends its headers and then
dribbles its body, or sends nothing, would hold that thread for as long as it liked: two such
unauthenticated POSTs stopped the whole API. This guard sits in front of the threads and reads the body
in the event loop, where a waiting request costs nothing:

* a Content-Length over the limit is a 413 at once, the body unread;
* a body still incomplete ``timeout_s`` after the request arrived is a 408, the connection closed;
* a body that grows past the limit as it arrives (chunked, or longer than declared) is a 413;
* the rest reaches the app buffered, as one message (an empty one when there is no body), so the app
  never waits on the client, nor hears that it left before its request took a thread.

A body sent with ``Transfer-Encoding: chunked`` has no Content-Length, and Django under WSGI (how the
control plane runs its views: controlplane/asgi.py) reads only ``CONTENT_LENGTH`` bytes: none, so a
chunked JSON POST arrived empty. Such a body is handed on with its Content-Length.

Refusals are JSON (``{"detail": …}``) like the API's other errors.
"""

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_BODY_TIMEOUT_S = 10.0


async def send_refusal(send: Send, status: int, detail: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Answer ``status`` with ``{"detail": detail}`` and close the connection (what is left unread of the
    request must not be taken for the next one)."""
    body = json.dumps({"detail": detail}).encode()
    fixed = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*fixed, (b"connection", b"close"), *(headers or [])],
        }
    )
    await send({"type": "http.response.body", "body": body})


def limit_body(app: ASGIApp, max_bytes: int, *, timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> ASGIApp:
    """Wrap ``app`` so that an HTTP request reaches it with its body read whole: 413 for a body over
    ``max_bytes`` (unread when its Content-Length says so), 408 for one not whole within ``timeout_s``.

    Other scopes (websockets, lifespan) pass through unchanged.
    """
    over_limit = f"the request body is over the limit of {max_bytes} bytes"
    too_slow = f"the request body did not arrive within {timeout_s:g} s"

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        length = _declared_length(scope)
        if length is not None and length > max_bytes:
            await send_refusal(send, 413, over_limit)
            return
        chunked = length is None and _chunked(scope)
        if not length and not chunked:
            # No body: nothing to wait for. The app is handed the empty body at once rather than the server's
            # receive: a client that leaves while its request waits for a thread would otherwise make that
            # receive answer http.disconnect, which Django's WSGI wrapper takes for a broken server
            # ("WSGI wrapper received a non-HTTP-request message"). Its request is whole: it runs as sent.
            await app(*_with_body(scope, receive, b"", chunked=False), send)
            return
        try:
            async with asyncio.timeout(timeout_s):
                body = await _read_body(receive, max_bytes)
        except TimeoutError:
            await send_refusal(send, 408, too_slow)
            return
        if body is None:  # the client left
            return
        if len(body) > max_bytes:
            await send_refusal(send, 413, over_limit)
            return
        await app(*_with_body(scope, receive, body, chunked=chunked), send)

    return guarded


async def _read_body(receive: Receive, max_bytes: int) -> bytes | None:
    """The body's bytes, or as soon as there are more than ``max_bytes`` of them, those; None when the
    client disconnects first."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        if len(body) > max_bytes or not message.get("more_body", False):
            return bytes(body)


def _declared_length(scope: Scope) -> int | None:
    """The Content-Length (0 when it is not a number); None when there is none."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else 0
    return None


def _chunked(scope: Scope) -> bool:
    return any(name == b"transfer-encoding" and b"chunked" in value.lower() for name, value in scope.get("headers", ()))


def _with_body(scope: Scope, receive: Receive, body: bytes, *, chunked: bool) -> tuple[Scope, Receive]:
    """The scope (a chunked one with a Content-Length instead of its Transfer-Encoding) and a receive that
    gives ``body`` first."""
    if chunked:
        headers = [(name, value) for name, value in scope["headers"] if name != b"transfer-encoding"]
        headers.append((b"content-length", str(len(body)).encode()))
        scope = {**scope, "headers": headers}
    given = False

    async def replay() -> MutableMapping[str, Any]:
        nonlocal given
        if given:
            return await receive()  # what follows the body: the client's disconnect
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return scope, replay
