"""Driving the gateway's ASGI app in this process, message by message, for tests that need to control
what the server sees (a client that stops reading, then leaves) and what the engine does."""

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from runtime.engine import RequestContext
from runtime.protocol import EngineOutput, PreprocessedRequest

Message = dict[str, Any]


@dataclass
class Client:
    """One HTTP exchange: the request body, the messages sent back, and a way to leave."""

    body: bytes
    sent: list[Message] = field(default_factory=list)
    left: asyncio.Event = field(default_factory=asyncio.Event)
    _body_taken: bool = False

    async def receive(self) -> Message:
        if not self._body_taken:
            self._body_taken = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int:
        return int(self.sent[0]["status"])

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(self.sent[0]["headers"])

    @property
    def content(self) -> bytes:
        return b"".join(message.get("body", b"") for message in self.sent[1:])

    def events(self) -> list[Any]:
        """The SSE data payloads, decoded (``[DONE]`` kept as the string)."""
        events: list[Any] = []
        for block in self.content.decode().split("\n\n"):
            if block.startswith("data: "):
                data = block.removeprefix("data: ")
                events.append(data if data == "[DONE]" else msgspec.json.decode(data))
        return events


def scope(path: str) -> dict[str, Any]:
    return {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(b"content-type", b"application/json")],
    }


async def call(
    app: Callable[[Any, Any, Any], Awaitable[None]], path: str, body: object, client: Client | None = None
) -> Client:
    """Run one request through ``app`` to its end; returns the client with what was sent to it."""
    client = client or Client(msgspec.json.encode(body))
    await app(scope(path), client.receive, client.send)
    return client


class TokenScript:
    """A token engine that yields ``tokens`` one per output, then raises ``error`` or finishes.

    ``closed`` is set when its stream is closed, however that happens.
    """

    kind: Literal["token"] = "token"
    skip_special_tokens = True

    def __init__(self, tokens: list[int], *, error: BaseException | None = None, endless: bool = False) -> None:
        self.tokens = tokens
        self.error = error
        self.endless = endless
        self.closed = asyncio.Event()
        self.contexts: list[RequestContext] = []

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def generate(self, request: PreprocessedRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        self.contexts.append(context)
        try:
            while True:
                for token in self.tokens:
                    await asyncio.sleep(0)  # a real engine waits for its tokens
                    yield EngineOutput([token])
                if not self.endless:
                    break
            if self.error is not None:
                raise self.error
            yield EngineOutput([], "stop")
        finally:
            self.closed.set()
