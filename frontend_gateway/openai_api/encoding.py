"""OpenAI response bodies and server-sent-event frames, encoded straight to bytes.

Streaming is the hot path: each frame is a pre-encoded prefix, the JSON-escaped text piece and a
pre-encoded suffix, so a token costs one string encode and a concatenation.
"""

from typing import Any, Literal

import msgspec

from frontend_gateway.parsers.calls import ToolCall

Kind = Literal["chat", "completion"]

_encode = msgspec.json.encode
DONE_FRAME = b"data: [DONE]\n\n"


def openai_finish_reason(reason: str | None) -> str | None:
    # "cancelled" and "error" are ours; OpenAI clients know only stop/length/tool_calls/content_filter.
    if reason is None or reason in ("stop", "length", "tool_calls"):
        return reason
    return "stop"


def chat_message(
    content: str, *, reasoning: str | None = None, tool_calls: list[ToolCall] | None = None
) -> dict[str, Any]:
    """The assistant message of a whole chat answer.

    ``reasoning`` (None: the model has no reasoning parser) becomes ``reasoning_content``, as vLLM and
    Dynamo name it; with tool calls and no text, ``content`` is null, as OpenAI sends it.
    """
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning or None
    if tool_calls:
        message["tool_calls"] = [call.as_openai() for call in tool_calls]
        message["content"] = content or None
    return message


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None, reasoning_tokens: int | None = None
) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` when the engine reported cache hits
    (as vLLM reports them, and benchmark clients such as AIPerf read them), and
    ``completion_tokens_details.reasoning_tokens`` when the model has a reasoning parser."""
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


def full_response(
    kind: Kind,
    *,
    response_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int | None = None,
    reasoning_tokens: int | None = None,
    nvext: dict[str, Any] | None = None,
    message: dict[str, Any] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> bytes:
    """The body of a non-streaming chat.completion or text_completion (``nvext`` added when given).

    ``message``, for a chat answer that went through parsers, replaces the plain one holding ``text``.
    """
    choice: dict[str, Any]
    if kind == "chat":
        choice = {
            "index": 0,
            "message": message or {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": openai_finish_reason(finish_reason),
        }
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": openai_finish_reason(finish_reason),
        }
        obj = "text_completion"
    body: dict[str, Any] = {
        "id": response_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens),
    }
    if nvext is not None:
        body["nvext"] = nvext
    return _encode(body)


class StreamEncoder:
    """Builds the SSE frames of one streamed response."""

    __slots__ = ("_head", "_kind", "_piece_prefix", "_piece_suffix")

    def __init__(self, kind: Kind, *, response_id: str, created: int, model: str) -> None:
        self._kind = kind
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        head = _encode({"id": response_id, "object": obj, "created": created, "model": model})
        self._head = b"data: " + head[:-1] + b',"choices":['
        if kind == "chat":
            self._piece_prefix = self._head + b'{"index":0,"delta":{"content":'
            self._piece_suffix = b'},"logprobs":null,"finish_reason":null}]}\n\n'
        else:
            self._piece_prefix = self._head + b'{"index":0,"text":'
            self._piece_suffix = b',"logprobs":null,"finish_reason":null}]}\n\n'

    def first(self) -> bytes | None:
        """The opening frame (chat announces the assistant role), or None for completions."""
        if self._kind == "chat":
            role = b'{"index":0,"delta":{"role":"assistant","content":""},'
            return self._head + role + b'"logprobs":null,"finish_reason":null}]}\n\n'
        return None

    def piece(self, text: str) -> bytes:
        return self._piece_prefix + _encode(text) + self._piece_suffix

    def delta(
        self,
        reasoning: str,
        content: str,
        tool_calls: list[dict[str, Any]],
        logprobs: dict[str, Any] | None = None,
        finish_reason: str | None = None,
    ) -> bytes:
        """A chunk of an answer that went through parsers or carries log probabilities: a chat delta
        (reasoning, content, tool-call pieces each with its index), or a completion's text."""
        choice: dict[str, Any] = {"index": 0}
        if self._kind == "chat":
            delta: dict[str, Any] = {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content:
                delta["content"] = content
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice["delta"] = delta
        else:
            choice["text"] = content
        choice["logprobs"] = logprobs
        choice["finish_reason"] = openai_finish_reason(finish_reason)
        return self._head + _encode(choice) + b"]}\n\n"

    def finish(self, finish_reason: str | None, nvext: dict[str, Any] | None = None) -> bytes:
        reason = _encode(openai_finish_reason(finish_reason))
        extra = b',"nvext":' + _encode(nvext) if nvext is not None else b""
        if self._kind == "chat":
            choice = b'{"index":0,"delta":{},"logprobs":null,"finish_reason":'
        else:
            choice = b'{"index":0,"text":"","logprobs":null,"finish_reason":'
        return self._head + choice + reason + b"}]" + extra + b"}\n\n"

    def usage(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int | None = None,
        reasoning_tokens: int | None = None,
    ) -> bytes:
        counts = usage(prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens)
        return self._head + b'],"usage":' + _encode(counts) + b"}\n\n"


def error_body(message: str, error_type: str, code: str | None, param: str | None) -> bytes:
    """The OpenAI error envelope."""
    return _encode({"error": {"message": message, "type": error_type, "param": param, "code": code}})


def error_frame(message: str, error_type: str, code: str | None) -> bytes:
    """An error reported inside an already-started stream (the status line is already sent)."""
    return b"data: " + error_body(message, error_type, code, None) + b"\n\n"
