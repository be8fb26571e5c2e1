"""``stream_options.continuous_usage_stats``: usage so far in every chunk of a stream, as vLLM sends it.

vLLM adds ``"usage": {"prompt_tokens", "completion_tokens", "total_tokens"}`` to each chunk when a request
asks for it with ``include_usage``. The chunks here are pre-encoded SSE frames (the hot path builds no
objects per token), so this wraps the ASGI ``send`` of a stream that asked for it and adds the usage to
each chunk frame it passes on: what asked for it pays for it, and nothing else changes.
"""

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec

from frontend_gateway.models.pipeline import Generation
from frontend_gateway.openai_api import encoding

__all__ = ["with_usage_in_every_chunk"]

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_CHUNK = b'data: {"id":'  # a chunk: not an error event, not [DONE]
_USAGE_CHUNK = b'"choices":[],'  # the closing usage chunk has its usage already (quotes unescaped: not text)


def with_usage_in_every_chunk(send: Send, counted: Callable[[], Generation]) -> Send:
    """``send``, adding to every chunk frame the usage of the generation that ``counted`` gives at that
    moment (a batch's total is summed when asked)."""

    async def send_with_usage(message: MutableMapping[str, Any]) -> None:
        body = message.get("body")
        if message["type"] == "http.response.body" and body:
            generation = counted()
            counts = (generation.prompt_tokens, generation.completion_tokens, generation.cached_tokens)
            message = {**message, "body": _add_usage(body, counts)}
        await send(message)

    return send_with_usage


def _add_usage(body: bytes, counts: tuple[int, int, int | None]) -> bytes:
    usage = b',"usage":' + msgspec.json.encode(encoding.usage(*counts)) + b"}"
    frames = body.split(b"\n\n")
    for number, frame in enumerate(frames):
        if frame.startswith(_CHUNK) and _USAGE_CHUNK not in frame:
            frames[number] = frame[:-1] + usage  # the frame's object ends with its last byte, "}"
    return b"\n\n".join(frames)
