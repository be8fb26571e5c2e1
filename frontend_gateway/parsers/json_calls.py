"""A tool call's JSON object read as it streams, so that its arguments can be sent as they are written.

``CallObject`` reads one ``{"name": …, "arguments": {…}}`` (or ``"parameters"``, Llama's name) a piece at
a time: once the name is written and the arguments open (the object's first nested value), the call is
announced, and each piece of the arguments' JSON text is passed on as it arrives, up to the bracket that
closes them. An object whose first keys are not the name then the arguments, or whose arguments are not
an object or a list, is read whole and parsed when it closes. ``JsonSpan`` says where a JSON object or
list ends, strings and escapes respected.
"""

import json
import re

from frontend_gateway.parsers.calls import CallPiece, ToolCall

__all__ = ["CallObject", "JsonSpan", "call_from"]

# The head of a call that can stream: the name, then the arguments' opening bracket (the last character).
_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*[\[{]')


def call_from(value: object, call_id: str) -> ToolCall | None:
    """A call from decoded JSON ``{"name": str, "arguments" | "parameters": object | str}``, else None."""
    if not isinstance(value, dict) or not isinstance(name := value.get("name"), str) or not name:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(call_id, name, arguments)


class JsonSpan:
    """Where a JSON object or list ends, read a piece at a time from its opening bracket."""

    __slots__ = ("_escape", "_in_string", "depth")

    def __init__(self) -> None:
        self.depth = 0
        self._in_string = False
        self._escape = False

    def step(self, char: str) -> None:
        """Read one character."""
        if self._in_string:
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._in_string = False
        elif char == '"':
            self._in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1

    def end_in(self, text: str) -> int:
        """Read ``text``; returns where in it the value ended (the index after its closing bracket), or -1."""
        for offset, char in enumerate(text):
            self.step(char)
            if self.depth == 0:
                return offset + 1
        return -1


class CallObject:
    """One call's JSON object, from its ``{``, as it arrives. ``feed`` returns the call's pieces."""

    __slots__ = (
        "_announced",
        "_args_end",
        "_args_start",
        "_checked",
        "_head",
        "_sent",
        "_span",
        "closed",
        "id",
        "index",
        "is_call",
        "raw",
        "rest",
    )

    def __init__(self, index: int, call_id: str) -> None:
        self.index = index
        self.id = call_id
        self.raw = ""  # the object's text so far
        self.rest = ""  # text fed after the object closed
        self.closed = False
        #: Whether this is a call: announced (its name read), or parsed as one when it closed.
        self.is_call = False
        self._span = JsonSpan()
        self._checked = False  # whether the head was looked for (when the first nested value opened)
        self._head: str | None = None  # the name, once the head matched
        self._args_start = -1
        self._args_end = -1
        self._sent = 0
        self._announced = False

    def feed(self, text: str) -> list[CallPiece]:
        """Read ``text``; returns the pieces of the call it completes (the rest, past the object, is kept
        in ``rest``)."""
        if self.closed:
            self.rest += text
            return []
        span = self._span
        base = len(self.raw)
        for offset, char in enumerate(text):
            span.step(char)
            if span.depth == 2 and not self._checked:
                # The first nested value opened: the arguments, if the name came first.
                self._checked = True
                self._match_head(self.raw + text[: offset + 1], base + offset)
            elif self._args_start >= 0 and self._args_end < 0 and span.depth == 1:
                self._args_end = base + offset + 1
            if span.depth == 0:
                self.raw += text[: offset + 1]
                self.rest = text[offset + 1 :]
                self.closed = True
                return self._pieces()
        self.raw += text
        return self._pieces()

    def _match_head(self, raw: str, position: int) -> None:
        match = _HEAD.fullmatch(raw)
        if match is None:
            return
        try:
            name = json.loads(match.group(1))
        except ValueError:
            return
        if name:
            self._head = name
            self._args_start = self._sent = position
            self.is_call = True

    def _pieces(self) -> list[CallPiece]:
        if self._head is not None:
            end = self._args_end if self._args_end >= 0 else len(self.raw)
            written, self._sent = self.raw[self._sent : end], end
            if not self._announced:
                self._announced = True
                return [CallPiece(self.index, written, self.id, self._head)]
            return [CallPiece(self.index, written)] if written else []
        if not self.closed:
            return []
        try:
            call = call_from(json.loads(self.raw), self.id)
        except ValueError:
            call = None
        if call is None:
            return []
        self.is_call = True
        return [CallPiece(self.index, call.arguments, call.id, call.name)]
