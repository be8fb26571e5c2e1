"""The baseline of bench/gateway_overhead.py: the least an ASGI server can do for the same exchange.

It reads the chat request, decodes it, and streams the last message back one character per SSE
frame, like ``flotilla run in=http out=echo_full`` with zero delay, but with no validation, no
pipeline, no metrics. Run under the same uvicorn settings as the gateway.
"""

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec

Message = MutableMapping[str, Any]

_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


async def app(
    scope: MutableMapping[str, Any],
    receive: Callable[[], Awaitable[Message]],
    send: Callable[[Message], Awaitable[None]],
) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    if scope["path"] == "/live":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    text = msgspec.json.decode(body)["messages"][-1]["content"]
    await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
    for char in text:
        frame = b'data: {"choices":[{"index":0,"delta":{"content":' + msgspec.json.encode(char) + b"}}]}\n\n"
        await send({"type": "http.response.body", "body": frame, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
