"""OpenAI's Responses API (``POST /v1/responses``) over the chat pipeline: text in, text out, streamed
as its typed events.

A Responses request becomes a chat request (``to_chat``: instructions a system message, input items
messages, function tools chat tools, ``text.format`` a ``response_format``), so that templates,
parsers, structured output and the engines are the chat path's. The answer's parts become output
items: ``reasoning`` (a model with a reasoning parser), ``message`` (its text) and ``function_call``
(each tool call).

Stored responses (``store``, and ``previous_response_id`` naming one) are the control plane's
(controlplane/stored_responses/): the gateway hands a response over as it answers, with the conversation it
ends (``conversation_items``), and reads a conversation back for a request that continues one (``history``
of ``to_chat``). ``conversation`` and ``background`` are refused (400).
"""

import time
import uuid
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from frontend_gateway.errors import InvalidRequest
from frontend_gateway.openai_api.chat_output import Delta
from frontend_gateway.openai_api.types import (
    ChatCompletionRequest,
    PositiveInt,
    Role,
    Temperature,
    chat_decoder,
)
from frontend_gateway.parsers.calls import CallPiece, ToolCall

__all__ = ["ResponseBuilder", "ResponsesRequest", "decoder", "to_chat"]

_encode = msgspec.json.encode


class InputPart(msgspec.Struct, omit_defaults=True):
    """A content part: text (``input_text``, ``output_text``, ``reasoning_text``) or an ``input_image`` (its
    ``image_url``: an http(s) URL or a data URI, as chat's ``image_url`` parts take them)."""

    type: str
    text: str | None = None
    image_url: str | None = None
    detail: str | None = None
    file_id: str | None = None


class InputItem(msgspec.Struct, kw_only=True):
    """An input item: a message (the default type), or from a past turn its reasoning, a function call and
    the call's output. A response's own output items are input items too (``input += response.output``):
    their ``id`` and ``status`` are not needed, and ignored."""

    type: Literal["message", "reasoning", "function_call", "function_call_output"] = "message"
    role: Role | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None


class FunctionTool(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: str
    name: Annotated[str, Meta(min_length=1, max_length=64)] | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(msgspec.Struct):
    type: Literal["function"]
    name: Annotated[str, Meta(min_length=1)]


class TextFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct):
    format: TextFormat | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    input: str | Annotated[list[InputItem], Meta(min_length=1)]
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None
    # Harmless to ignore (docs/openai-api.md): billing and caching hints.
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    previous_response_id: Annotated[str, Meta(min_length=1, max_length=100)] | None = None
    # Accepted only to be refused: no conversations objects, nothing runs in the background.
    conversation: Any | None = None
    background: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None


decoder = msgspec.json.Decoder(ResponsesRequest)


def _refuse_unsupported(request: ResponsesRequest) -> None:
    if request.conversation is not None:
        raise InvalidRequest(
            "conversation objects are not supported; continue a conversation with previous_response_id, or send "
            "it whole as input",
            param="conversation",
        )
    if request.background:
        raise InvalidRequest("background responses are not supported; leave background out", param="background")
    if request.top_logprobs:
        raise InvalidRequest(
            "top_logprobs are not supported on /v1/responses; use /v1/chat/completions", param="top_logprobs"
        )


_TEXT_PARTS = ("input_text", "output_text")


def _text(parts: str | list[InputPart] | None, param: str, kinds: tuple[str, ...] = _TEXT_PARTS) -> str | None:
    """The text of content given as a string or as text parts. Raises InvalidRequest for other parts."""
    if not isinstance(parts, list):
        return parts
    texts = []
    for part in parts:
        if part.type not in kinds or part.text is None:
            raise InvalidRequest(
                f"content part of type {part.type!r} is not supported; only text parts are", param=param
            )
        texts.append(part.text)
    return "".join(texts)


def _message(index: int, item: InputItem) -> dict[str, Any]:
    role = "system" if item.role == "developer" else item.role
    if role is None:
        raise InvalidRequest("a message input item needs a role", param=f"input[{index}].role")
    if isinstance(item.content, list) and any(part.type not in _TEXT_PARTS for part in item.content):
        return {"role": role, "content": _parts_with_images(item.content, f"input[{index}].content")}
    content = _text(item.content, f"input[{index}].content")
    if content is None:
        raise InvalidRequest("a message input item needs content", param=f"input[{index}].content")
    return {"role": role, "content": content}


def _parts_with_images(parts: list[InputPart], param: str) -> list[dict[str, Any]]:
    """Content with images as chat's content parts: the gateway loads and checks the images as it does chat's
    (``image_url`` parts), and a model that takes none refuses them. Raises InvalidRequest for other parts."""
    converted: list[dict[str, Any]] = []
    for number, part in enumerate(parts):
        if part.type in _TEXT_PARTS and part.text is not None:
            converted.append({"type": "text", "text": part.text})
        elif part.type == "input_image" and part.image_url:
            image: dict[str, Any] = {"url": part.image_url}
            if part.detail is not None:
                image["detail"] = part.detail
            converted.append({"type": "image_url", "image_url": image})
        elif part.type == "input_image":
            raise InvalidRequest(
                "an input_image needs its image_url (an http(s) URL or a data URI); images by file_id are not "
                "supported",
                param=f"{param}[{number}]",
            )
        else:
            raise InvalidRequest(
                f"content part of type {part.type!r} is not supported; text and input_image parts are",
                param=f"{param}[{number}]",
            )
    return converted


def _assistant_turn(messages: list[dict[str, Any]], reasoning: str | None) -> dict[str, Any]:
    """The assistant message that a function call joins: the last message if it is the assistant's (its text
    or calls: a response's message and calls are one turn), else a new one (with the reasoning before it)."""
    previous = messages[-1] if messages else None
    if previous is not None and previous["role"] == "assistant":
        previous.setdefault("tool_calls", [])
        return previous
    turn: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": []}
    if reasoning is not None:
        turn["reasoning_content"] = reasoning
    messages.append(turn)
    return turn


def _messages(request: ResponsesRequest, history: list[InputItem]) -> list[dict[str, Any]]:
    """The chat messages the input stands for (after the ``history`` it continues, if any): function calls
    join the assistant turn they belong to. The instructions come first; a previous response's are not
    carried over, as OpenAI does."""
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    items = [*history, *_as_items(request.input)]
    reasoning: str | None = None  # a reasoning item's text, for the assistant turn that follows it
    for index, item in enumerate(items):
        if item.type == "reasoning":
            # As vLLM takes it back: the reasoning of the assistant's next turn (its reasoning_content,
            # which templates such as Qwen3's show within a tool loop); dropped if no such turn follows.
            reasoning = _text(item.content, f"input[{index}].content", ("reasoning_text",)) or ""
            continue
        if item.type == "message":
            message = _message(index, item)
            if message["role"] == "assistant" and reasoning is not None:
                message["reasoning_content"] = reasoning
            messages.append(message)
        elif item.type == "function_call":
            if not item.call_id or not item.name or item.arguments is None:
                raise InvalidRequest(
                    "a function_call input item needs call_id, name and arguments", param=f"input[{index}]"
                )
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            _assistant_turn(messages, reasoning)["tool_calls"].append(call)
        else:
            output = _text(item.output, f"input[{index}].output")
            if not item.call_id or output is None:
                raise InvalidRequest(
                    "a function_call_output input item needs call_id and output", param=f"input[{index}]"
                )
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        reasoning = None
    return messages


def _tools(request: ResponsesRequest) -> list[dict[str, Any]] | None:
    if request.tools is None:
        return None
    tools = []
    for index, tool in enumerate(request.tools):
        if tool.type != "function" or tool.name is None:
            raise InvalidRequest(
                f"tools of type {tool.type!r} are not supported; only named functions are", param=f"tools[{index}]"
            )
        function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
        tools.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return tools or None


def _response_format(request: ResponsesRequest) -> dict[str, Any] | None:
    text_format = request.text.format if request.text is not None else None
    if text_format is None or text_format.type != "json_schema":
        return None if text_format is None else {"type": text_format.type}
    spec = {"name": text_format.name or "output", "schema": text_format.schema, "strict": text_format.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


def _as_items(given: str | list[InputItem]) -> list[InputItem]:
    return [InputItem(role="user", content=given)] if isinstance(given, str) else given


def _item_object(item: InputItem) -> dict[str, Any]:
    """An input item as OpenAI lists it: without empty fields, a message's text as a content part."""
    shown: dict[str, Any] = {k: v for k, v in msgspec.to_builtins(item).items() if v is not None}
    if item.type == "message" and isinstance(item.content, str):
        part = "output_text" if item.role == "assistant" else "input_text"
        shown["content"] = [{"type": part, "text": item.content}]
    return shown


def input_items(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items (a string is a user message), for storing."""
    return [_item_object(item) for item in _as_items(request.input)]


def conversation_items(history: list[InputItem], request: ResponsesRequest, output: list[dict[str, Any]]) -> list[Any]:
    """The conversation a response ends: what it continued, its input, its output (as a later request's input)."""
    return [*(_item_object(item) for item in history), *input_items(request), *output]


history_decoder = msgspec.json.Decoder(list[InputItem])


def to_chat(request: ResponsesRequest, history: list[InputItem] | None = None) -> ChatCompletionRequest:
    """The chat request that ``request`` stands for, continuing ``history`` (the items of the conversation
    its ``previous_response_id`` names). Raises InvalidRequest for what cannot be served."""
    _refuse_unsupported(request)
    choice = request.tool_choice
    body: dict[str, Any] = {
        "model": request.model,
        "messages": _messages(request, history or []),
        "stream": request.stream,
        "max_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "tools": _tools(request),
        "tool_choice": {"type": "function", "function": {"name": choice.name}}
        if isinstance(choice, NamedFunction)
        else choice,
        "parallel_tool_calls": request.parallel_tool_calls,
        "response_format": _response_format(request),
        "user": request.user,
    }
    # Through the chat decoder, so that the chat path's own checks hold.
    try:
        chat: ChatCompletionRequest = chat_decoder.decode(_encode({k: v for k, v in body.items() if v is not None}))
    except msgspec.ValidationError as exc:  # what the Responses types let through and chat's do not
        raise InvalidRequest(f"invalid request: {exc}") from exc
    return chat


def _usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None, reasoning_tokens: int | None
) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens or 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens or 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


class ResponseBuilder:
    """One response: its object, whole or as the stream of events that build it.

    Stream events are ``event: TYPE`` / ``data: {...}`` frames numbered by ``sequence_number``; the
    output items open as their first text arrives and close when another kind of item starts or the
    answer ends, as OpenAI's own stream does.
    """

    def __init__(self, request: ResponsesRequest, *, response_id: str, model: str, store: bool = False) -> None:
        self.request = request
        #: Whether the response is handed to the control plane to keep (its body says so).
        self.store = store
        self.id = "resp_" + response_id
        self.model = model
        self.created_at = int(time.time())
        self.output: list[dict[str, Any]] = []
        self._sequence = 0
        self._open: dict[str, Any] | None = None  # the item receiving text (reasoning, message) or arguments

    def body(
        self, status: str, *, incomplete: str | None = None, usage: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        request = self.request
        tool_choice = request.tool_choice
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "model": self.model,
            "output": self.output,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "store": self.store,
            "temperature": request.temperature,
            "text": {"format": msgspec.to_builtins(request.text.format)}
            if request.text is not None and request.text.format is not None
            else {"format": {"type": "text"}},
            "tool_choice": msgspec.to_builtins(tool_choice) if tool_choice is not None else "auto",
            "tools": msgspec.to_builtins(request.tools or []),
            "top_p": request.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": request.user,
            "metadata": request.metadata or {},
        }

    # --- whole -----------------------------------------------------------------------------------

    def whole(
        self, parsed: Delta, calls: list[ToolCall], *, finish_reason: str | None, usage: dict[str, Any]
    ) -> dict[str, Any]:
        """The body of a non-streamed response holding ``parsed`` and the tool ``calls``."""
        if parsed.reasoning:
            self.output.append(self._reasoning_item(parsed.reasoning, "completed"))
        if parsed.content:
            self.output.append(self._message_item(parsed.content, "completed"))
        self.output += [self._call_item(call) for call in calls]
        status, incomplete = _status(finish_reason)
        return self.body(status, incomplete=incomplete, usage=usage)

    @staticmethod
    def usage(
        prompt_tokens: int, completion_tokens: int, cached_tokens: int | None, reasoning_tokens: int | None = None
    ) -> dict[str, Any]:
        return _usage(prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens)

    # --- streamed --------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = _encode({"type": kind, "sequence_number": self._sequence, **fields})
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def start(self) -> bytes:
        body = self.body("in_progress")
        return self._event("response.created", response=body) + self._event("response.in_progress", response=body)

    def delta(self, delta: Delta) -> bytes:
        """The events of one parsed piece of the answer."""
        frames = b""
        pieces = delta.tool_calls
        # The arguments of a call open before this piece of text came first in it (text cannot come
        # before a call's end): they go to the call's item before text closes it.
        ending = next((number for number, piece in enumerate(pieces) if piece.id is not None), len(pieces))
        for piece in pieces[:ending]:
            frames += self._call_piece(piece)
        if delta.reasoning:
            frames += self._text("reasoning", delta.reasoning)
        if delta.content:
            frames += self._text("message", delta.content)
        for piece in pieces[ending:]:
            frames += self._call_piece(piece)
        return frames

    def _call_piece(self, piece: CallPiece) -> bytes:
        """A tool call's first piece opens its item; the next ones add to its arguments."""
        frames = b""
        if piece.id is not None:
            frames += self._close()
            item = self._call_item(ToolCall(piece.id, piece.name or "", ""))
            item["status"] = "in_progress"
            self._open = item
            self.output.append(item)
            frames += self._event("response.output_item.added", output_index=len(self.output) - 1, item=item)
        current = self._open
        if current is None or current["type"] != "function_call" or not piece.arguments:
            return frames
        current["arguments"] += piece.arguments
        where = {"item_id": current["id"], "output_index": len(self.output) - 1}
        return frames + self._event("response.function_call_arguments.delta", **where, delta=piece.arguments)

    def finish(self, *, finish_reason: str | None, usage: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
        """The frames that close what is open, and the final body (which ``finished`` sends)."""
        status, incomplete = _status(finish_reason)
        return self._close(), self.body(status, incomplete=incomplete, usage=usage)

    def finished(self, body: dict[str, Any]) -> bytes:
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        return self._event(kind, response=body)

    def error(self, message: str, code: str | None) -> bytes:
        """The end of a stream that failed after it started."""
        return self._event("error", code=code, message=message, param=None)

    def _text(self, kind: str, text: str) -> bytes:
        frames = b""
        if self._open is None or self._open["type"] != kind:
            frames += self._close()
            item = (
                self._reasoning_item("", "in_progress")
                if kind == "reasoning"
                else self._message_item("", "in_progress")
            )
            self._open = item
            self.output.append(item)
            index = len(self.output) - 1
            # As OpenAI sends it: the item without parts, then the part (a client appends it to the item).
            frames += self._event("response.output_item.added", output_index=index, item=item | {"content": []})
            part = item["content"][0]
            frames += self._event(
                "response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part
            )
        item = self._open
        item["content"][0]["text"] += text
        event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        fields: dict[str, Any] = {"item_id": item["id"], "output_index": len(self.output) - 1, "content_index": 0}
        if kind == "message":
            fields["logprobs"] = []
        return frames + self._event(event, **fields, delta=text)

    def _close(self) -> bytes:
        item, self._open = self._open, None
        if item is None:
            return b""
        index = self.output.index(item)
        item["status"] = "completed"
        if item["type"] == "function_call":
            done = self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=item["arguments"],
            )
            return done + self._event("response.output_item.done", output_index=index, item=item)
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "message":
            done = self._event("response.output_text.done", **where, text=part["text"], logprobs=[])
        else:
            done = self._event("response.reasoning_text.done", **where, text=part["text"])
        return (
            done
            + self._event("response.content_part.done", **where, part=part)
            + self._event("response.output_item.done", output_index=index, item=item)
        )

    # --- items -----------------------------------------------------------------------------------

    @staticmethod
    def _message_item(text: str, status: str) -> dict[str, Any]:
        return {
            "type": "message",
            "id": _new_id("msg_"),
            "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }

    @staticmethod
    def _reasoning_item(text: str, status: str) -> dict[str, Any]:
        return {
            "type": "reasoning",
            "id": _new_id("rs_"),
            "status": status,
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
        }

    @staticmethod
    def _call_item(call: ToolCall) -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": _new_id("fc_"),
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments,
            "status": "completed",
        }


def _status(finish_reason: str | None) -> tuple[str, str | None]:
    """The response's status, and why it is incomplete (it ran out of max_output_tokens)."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None
