"""What the tool-call parsers find: whole calls, and the pieces a call streams in."""

import uuid
from dataclasses import dataclass
from typing import Any

__all__ = ["CallPiece", "ToolCall", "new_call_id", "whole_piece"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call: the function's name and its arguments as a JSON string (as OpenAI sends them)."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` entry of a whole message."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class CallPiece:
    """A step of one tool call as it streams: its first piece names it (``id``, ``name``), the following
    ones add to its ``arguments``. ``index`` numbers the calls of one answer from 0."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def as_openai(self) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` entry of a stream delta."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


def new_call_id() -> str:
    """A fresh id for a call, in OpenAI's form (``call_`` and 24 characters)."""
    return "call_" + uuid.uuid4().hex[:24]


def whole_piece(index: int, call: ToolCall) -> CallPiece:
    """A call sent in one piece."""
    return CallPiece(index, call.arguments, call.id, call.name)
