"""The parts of an answer shared by the gateway's generation routes: its response headers and ids, the
frames of a stream that goes through parsers or carries log probabilities, the Responses API's answer, and
what a failure mid-stream becomes."""

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from frontend_gateway.errors import EngineFailed, GatewayError
from frontend_gateway.http_io import JSON_HEADERS, SSE_HEADERS, Send
from frontend_gateway.models.pipeline import Generation
from frontend_gateway.openai_api import encoding
from frontend_gateway.openai_api.chat_output import Delta
from frontend_gateway.openai_api.logprobs import CompletionLogprobs, chat_logprobs
from frontend_gateway.openai_api.responses_api import ResponseBuilder

log = logging.getLogger(__name__)


class RichFrames:
    """The frames of a streamed answer that goes through its model's parsers (chat_output), or carries
    log probabilities: each frame a dict encoded whole, off the fast path of plain text pieces."""

    __slots__ = ("_completion_logprobs", "_encoder", "_generation", "_kind", "_parser")

    def __init__(self, kind: encoding.Kind, encoder: encoding.StreamEncoder, generation: Generation) -> None:
        self._kind = kind
        self._encoder = encoder
        self._generation = generation
        self._parser = generation.output
        self._completion_logprobs = CompletionLogprobs()

    async def send(self, send: Send, piece: str) -> None:
        await self._send(send, self._parser.feed(piece) if self._parser is not None else Delta(content=piece))

    async def finish(self, send: Send) -> None:
        """Send what the parsers held back; raises ToolCallMissing if a required call never came."""
        if self._parser is not None:
            await self._send(send, self._parser.flush())
            self._parser.check_required(self._generation.finish_reason)
        await self._send(send, Delta())  # log probabilities of tokens whose text was held back or cut

    def finish_reason(self, reason: str | None) -> str | None:
        return self._parser.finish_reason(reason) if self._parser is not None else reason

    async def _send(self, send: Send, delta: Delta) -> None:
        entries = self._generation.take_logprobs()
        if not delta and not entries:
            return  # held back: part of a tag, or a call not yet complete
        calls = [piece.as_openai() for piece in delta.tool_calls]
        logprobs = None
        if self._generation.logprobs is not None:
            chat = self._kind == "chat"
            logprobs = chat_logprobs(entries) if chat else self._completion_logprobs.shape(entries)
        frame = self._encoder.delta(delta.reasoning, delta.content, calls, logprobs)
        await send({"type": "http.response.body", "body": frame, "more_body": True})


async def respond_responses(
    builder: ResponseBuilder,
    generation: Generation,
    stream: bool,
    send: Send,
    started: float,
    metrics: Any,
    store: Callable[[dict[str, Any]], Awaitable[bool]] | None = None,
) -> GatewayError | None:
    """Send a Responses API answer, whole or as its events; returns the failure that ended a stream.

    As for chat, a failure before the first piece propagates (a proper error status) and one after
    the status line ends the stream with an ``error`` event. ``store`` (when the response is kept) is
    handed the final body before its last bytes go, so that the client's next turn finds it; when it
    fails, the body says ``store: false``.
    """
    parser = generation.output
    parsed = Delta()
    async with contextlib.aclosing(generation):
        pieces = generation.pieces()
        first = await anext(pieces, None)
        if first is not None:
            metrics.ttft.observe(time.perf_counter() - started)
        if not stream:
            text = "".join([first or "", *[piece async for piece in pieces]])
            parsed.content = text
            if parser is not None:
                parsed = parser.feed(text).extend(parser.flush())
                parser.check_required(generation.finish_reason)
        else:
            headers = response_headers(SSE_HEADERS, generation)
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": builder.start(), "more_body": True})
            try:
                piece = first
                while piece is not None:
                    delta = parser.feed(piece) if parser is not None else Delta(content=piece)
                    if delta:
                        await send({"type": "http.response.body", "body": builder.delta(delta), "more_body": True})
                    piece = await anext(pieces, None)
                if parser is not None:
                    if delta := parser.flush():
                        await send({"type": "http.response.body", "body": builder.delta(delta), "more_body": True})
                    parser.check_required(generation.finish_reason)
            except Exception as exc:
                failure = as_gateway_error(exc, generation)
                await send({"type": "http.response.body", "body": builder.error(failure.message, failure.code)})
                return failure
    finish_reason = parser.finish_reason(generation.finish_reason) if parser else generation.finish_reason
    usage = builder.usage(
        generation.prompt_tokens, generation.completion_tokens, generation.cached_tokens, generation.reasoning_tokens
    )
    if stream:
        closing, body = builder.finish(finish_reason=finish_reason, usage=usage)
        await _store(store, body)
        await send({"type": "http.response.body", "body": closing + builder.finished(body)})
    else:
        calls = parser.calls if parser is not None else []
        body = builder.whole(parsed, calls, finish_reason=finish_reason, usage=usage)
        await _store(store, body)
        headers = response_headers(JSON_HEADERS, generation)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": msgspec.json.encode(body)})
    return None


async def _store(store: Callable[[dict[str, Any]], Awaitable[bool]] | None, body: dict[str, Any]) -> None:
    if store is not None and not await store(body):
        body["store"] = False


def as_gateway_error(exc: Exception, generation: Generation) -> GatewayError:
    """The error to report for a failure mid-stream, logged here (nothing else will see it)."""
    generation.finish_reason = "error"
    if isinstance(exc, GatewayError):
        log.warning("request %s failed mid-stream: %s", generation.request_id, exc.message)
        return exc
    log.error("request %s failed mid-stream", generation.request_id, exc_info=exc)
    return EngineFailed("internal error while generating; see the server log")


def response_headers(base: list[tuple[bytes, bytes]], generation: Generation) -> list[tuple[bytes, bytes]]:
    headers = [*base, (b"x-request-id", generation.request_id.encode())]
    if generation.context.served_by is not None:
        headers.append((b"x-flotilla-instance", generation.context.served_by.encode()))
    if generation.context.prefilled_by is not None:
        headers.append((b"x-flotilla-prefill-instance", generation.context.prefilled_by.encode()))
    return headers


def nvext(generation: Generation) -> dict[str, Any]:
    return {"instance_id": generation.context.served_by}


def response_id(kind: encoding.Kind, generation: Generation) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + generation.request_id
