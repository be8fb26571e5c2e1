"""What a chat answer's text becomes: reasoning, content and tool calls, by the model's parsers.

``plan_chat_output`` is the decision, made before any work: which parsers a request's answer goes
through, which tools its prompt shows, and whether the request can be honoured at all (a model with no
tool-call parser cannot return calls: tools are then refused unless ``tool_choice`` is ``"none"``).
``ChatOutputParser`` applies it to the answer, piece by piece; the gateway's fast path, plain text,
is untouched when a request needs no parser.

``tool_choice: "required"`` or a named function is enforced where the engine can constrain its output
(``structured_output``): the answer is held to a JSON schema of the call(s), as vLLM does, and read by
``parsers.forced_calls`` whatever the model's own format (no tool-call parser is needed then). Where it
cannot, the model's own format is parsed and the finished answer checked: one without the call is an
error (``ToolCallMissing``), never passed off as the call asked for. Either way a named function is the
only tool the prompt shows, so that the model has no other to choose.
"""

from dataclasses import dataclass, field
from typing import Any

import msgspec

from frontend_gateway.errors import InvalidRequest, ToolCallMissing
from frontend_gateway.openai_api.types import ChatCompletionRequest, NamedToolChoice, Tool
from frontend_gateway.parsers.calls import CallPiece, ToolCall
from frontend_gateway.parsers.forced_calls import (
    NamedCallParser,
    RequiredCallsParser,
    named_call_schema,
    required_calls_schema,
)
from frontend_gateway.parsers.reasoning import ReasoningParser, reasoning_parser
from frontend_gateway.parsers.tool_calls import TOOL_CALL_PARSERS, ToolCallParser, tool_call_parser

__all__ = ["ChatOutputParser", "ChatPlan", "Delta", "plan_chat_output"]


@dataclass(slots=True)
class Delta:
    """A step of a parsed answer; any part may be empty. ``tool_calls`` are the calls' pieces (a call's
    first piece names it, the next add to its arguments); the parser's ``calls`` are the calls whole."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[CallPiece] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def extend(self, other: "Delta") -> "Delta":
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


class ChatOutputParser:
    """One answer's text through a reasoning parser, then its content through a tool-call parser.

    ``required`` is None when no call is required, ``""`` when any call is, or the name of the
    function that must be called.
    """

    __slots__ = ("_calls", "_reasoning", "_tools", "has_reasoning", "max_calls", "required")

    def __init__(
        self,
        reasoning: ReasoningParser | None,
        tools: ToolCallParser | None,
        required: str | None = None,
        *,
        max_calls: int | None = None,
    ) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self.has_reasoning = reasoning is not None
        self.required = required
        #: 1 with ``parallel_tool_calls: false``: calls past the first are dropped.
        self.max_calls = max_calls
        self._calls: list[list[str]] = []  # id, name, arguments so far, of each call found

    @property
    def calls(self) -> list[ToolCall]:
        """The calls found so far, in order, each with the arguments written so far."""
        return [ToolCall(call_id, name, arguments) for call_id, name, arguments in self._calls]

    @property
    def needs_special_tokens(self) -> bool:
        """Whether the text must keep special tokens (a tool-call format's markers are some)."""
        return self._tools is not None and self._tools.needs_special_tokens

    def feed(self, text: str) -> Delta:
        """The parts of the answer that ``text`` completes."""
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(text)
        else:
            reasoning, content = "", text
        return self._content(reasoning, content, final=False)

    def flush(self) -> Delta:
        """The rest, at the end of the answer."""
        reasoning, content = self._reasoning.flush() if self._reasoning is not None else ("", "")
        return self._content(reasoning, content, final=True)

    def _content(self, reasoning: str, content: str, *, final: bool) -> Delta:
        if self._tools is None:
            return Delta(reasoning, content)
        shown, pieces = self._tools.feed(content) if content else ("", [])
        if final:
            tail, last = self._tools.flush()
            shown += tail
            pieces = [*pieces, *last]
        if self.max_calls is not None:
            pieces = [piece for piece in pieces if piece.index < self.max_calls]
        for piece in pieces:
            if piece.id is not None:
                self._calls.append([piece.id, piece.name or "", piece.arguments])
            else:
                self._calls[piece.index][2] += piece.arguments
        return Delta(reasoning, shown, pieces)

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's finish reason: ``tool_calls`` when the model chose to end by calling tools. A call that
        ``tool_choice`` forced (a named function, or ``required``) ends with ``stop``, as OpenAI's and vLLM's
        do: clients that loop until ``stop`` would otherwise never see one."""
        chose = self._calls and self.required is None
        return "tool_calls" if chose and reason == "stop" else reason

    def check_required(self, finish_reason: str | None) -> None:
        """Raise ToolCallMissing when the answer (which ended for ``finish_reason``) lacks the call
        that ``tool_choice`` asked for."""
        if self.required is None:
            return
        if not self._calls and finish_reason == "length":
            raise ToolCallMissing(
                "the answer reached max_tokens before the tool call asked for was complete; raise max_tokens"
            )
        if not self._calls:
            raise ToolCallMissing(
                "the model answered without calling a tool, although tool_choice required one; the answer "
                "was not constrained to a call (see README: tool calling), try again or use tool_choice auto"
            )
        if self.required and (other := next((c[1] for c in self._calls if c[1] != self.required), None)):
            raise ToolCallMissing(
                f"the model called {other!r}, although tool_choice named {self.required!r}; try again"
            )


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """How one chat request is served: the tools its prompt shows, the parser its answer goes through."""

    tools: list[dict[str, Any]] | None
    parser: ChatOutputParser | None
    #: The JSON schema (as JSON text) the engine must hold the answer to, for a forced tool call.
    json_schema: str | None = None


_PLAIN = ChatPlan(None, None)


def plan_chat_output(
    request: ChatCompletionRequest,
    *,
    model: str,
    reasoning: str | None,
    tool_calls: str | None,
    structured_output: bool = False,
) -> ChatPlan:
    """Decide how to serve ``request`` on a model with these parsers (by name; None: none) whose engine
    can, or cannot, constrain its output.

    Raises InvalidRequest when ``tools`` would be offered to a model whose calls cannot be parsed.
    """
    tools = request.tools
    if tools is None and reasoning is None:
        return _PLAIN  # most requests: plain text, nothing to decide
    choice = request.tool_choice
    max_calls = 1 if request.parallel_tool_calls is False else None
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    if tools is not None and forced and structured_output:
        return _forced_call_plan(request, tools, max_calls)
    if tools is None or choice == "none":
        # "none": the model is not shown tools it may not call (vLLM's --exclude-tools-when-tool-choice-none).
        tool_parser, shown, required = None, None, None
    else:
        if tool_calls is None:
            raise InvalidRequest(
                f"model {model!r} cannot return tool calls: it is served without a tool-call parser "
                f"(flotilla run --tool-call-parser {'|'.join(TOOL_CALL_PARSERS)}); leave tools out, "
                'or set tool_choice to "none"',
                param="tools" if choice is None else "tool_choice",
            )
        tool_parser = tool_call_parser(tool_calls)
        if isinstance(choice, NamedToolChoice):
            required = choice.function.name
            shown = [msgspec.to_builtins(tool) for tool in tools if tool.function.name == required]
        else:
            required = "" if choice == "required" else None
            shown = msgspec.to_builtins(tools)
    reasoner = reasoning_parser(reasoning) if reasoning is not None else None
    parser = ChatOutputParser(reasoner, tool_parser, required, max_calls=max_calls) if reasoner or tool_parser else None
    return ChatPlan(shown, parser)


def _forced_call_plan(request: ChatCompletionRequest, tools: list[Tool], max_calls: int | None) -> ChatPlan:
    """The plan of a required or named call on an engine that holds the answer to the call's schema.

    No reasoning parser: the answer is the JSON from its first token. Raises InvalidRequest when
    response_format also asks for a schema: the answer cannot be held to two.
    """
    if request.response_format is not None and request.response_format.get("type", "text") != "text":
        raise InvalidRequest(
            "response_format cannot be combined with a required or named tool_choice: both would "
            "constrain the same answer",
            param="response_format",
        )
    choice = request.tool_choice
    tool_parser: ToolCallParser
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        named = [tool for tool in tools if tool.function.name == name]
        schema = named_call_schema(named[0].function.parameters)
        tool_parser, shown, required = NamedCallParser(name), named, name
    else:
        offered = [(tool.function.name, tool.function.parameters) for tool in tools]
        schema = required_calls_schema(offered, parallel=max_calls is None)
        tool_parser, shown, required = RequiredCallsParser(), tools, ""
    parser = ChatOutputParser(None, tool_parser, required, max_calls=max_calls)
    return ChatPlan(msgspec.to_builtins(shown), parser, msgspec.json.encode(schema).decode())
