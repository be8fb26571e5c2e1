"""Tool calls an engine was made to write as JSON, whatever the model's own format (as vLLM does).

When ``tool_choice`` is ``"required"`` or names a function and the engine can constrain its output
(``structured_output``), the answer is held to a JSON schema instead of being left to the model:

* a named function: the answer *is* the call's arguments, held to the function's ``parameters``;
* ``required``: the answer is a list of ``{"name": …, "parameters": {…}}``, one of the offered tools
  each (one at most with ``parallel_tool_calls: false``).

These parsers hold the whole answer and read it at the end, sending each call whole: an answer cut off
by ``max_tokens`` is not the JSON, and is given back as content, which pieces already sent as a call's
arguments could not be. (The grammar already makes the answer come quickly: it has nothing else in it.)
"""

import abc
import json
from typing import Any

from frontend_gateway.parsers.calls import CallPiece, ToolCall, new_call_id
from frontend_gateway.parsers.tool_calls import ToolCallParser

__all__ = ["NamedCallParser", "RequiredCallsParser", "named_call_schema", "required_calls_schema"]


def named_call_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The schema of a named function's call: its parameters (any object when it declares none)."""
    return parameters or {"type": "object"}


def required_calls_schema(tools: list[tuple[str, dict[str, Any] | None]], *, parallel: bool) -> dict[str, Any]:
    """The schema of an answer that calls one or more of ``tools`` (name, parameters)."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"enum": [name]}, "parameters": named_call_schema(parameters)},
            "required": ["name", "parameters"],
        }
        for name, parameters in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class _HoldAll(ToolCallParser):
    def feed(self, text: str) -> tuple[str, list[CallPiece]]:
        self._held += text
        return "", []

    def flush(self) -> tuple[str, list[CallPiece]]:
        held, self._held = self._held, ""
        try:
            calls = self._calls(json.loads(held))
        except ValueError:
            calls = None
        return ("", self._pieces(calls)) if calls else (held, [])

    @abc.abstractmethod
    def _calls(self, value: Any) -> list[ToolCall] | None:
        """The calls in the answer's JSON ``value``; None when it is not what the grammar held it to."""


class NamedCallParser(_HoldAll):
    """The answer is the named function's arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def _calls(self, value: Any) -> list[ToolCall] | None:
        if not isinstance(value, dict):
            return None
        return [ToolCall(new_call_id(), self.name, json.dumps(value, ensure_ascii=False))]


class RequiredCallsParser(_HoldAll):
    """The answer is a list of ``{"name", "parameters"}``."""

    def _calls(self, value: Any) -> list[ToolCall] | None:
        if not isinstance(value, list) or not value:
            return None
        calls = []
        for item in value:
            if not isinstance(item, dict) or not isinstance(name := item.get("name"), str):
                return None
            arguments = json.dumps(item.get("parameters", {}), ensure_ascii=False)
            calls.append(ToolCall(new_call_id(), name, arguments))
        return calls
