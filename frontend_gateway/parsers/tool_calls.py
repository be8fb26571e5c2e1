"""Tool-call parsers: find the calls a model writes into its text, by the model's own format.

The names are vLLM's (``--tool-call-parser``):

* ``hermes``: ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``, any number, text around them
  is content (Hermes 2/3, Qwen 2.5/3 and others trained on that format).
* ``llama3_json``: the whole answer is ``{"name": …, "parameters": {…}}``, optionally after
  ``<|python_tag|>``, several separated by ``;`` (Llama 3.1/3.2 with JSON tool calling). An answer
  that does not open with ``{`` or the tag is content.
* ``mistral``: ``[TOOL_CALLS]`` followed by a JSON list of ``{"name", "arguments"}`` (or, from
  Mistral's v11 tokenizer on, ``name[ARGS]{…}`` per call); text before it is content.

As Dynamo does, text that may be a call is held back ("jailed") until the call is complete, and each
call is sent whole, in one delta: its name and all its arguments. Text that looked like a call but
does not parse as one is given back as content, never dropped.
"""

import abc
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["TOOL_CALL_PARSERS", "ToolCall", "ToolCallParser", "tool_call_parser"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call: the function's name and its arguments as a JSON string (as OpenAI sends them)."""

    id: str
    name: str
    arguments: str

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` entry (a stream delta's entry also carries its ``index``)."""
        body: dict[str, Any] = {} if index is None else {"index": index}
        body |= {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return body


def new_call_id() -> str:
    """A fresh id for a call, in OpenAI's form (``call_`` and 24 characters)."""
    return "call_" + uuid.uuid4().hex[:24]


def _call_from(value: object) -> ToolCall | None:
    """A call from decoded JSON ``{"name": str, "arguments" | "parameters": object | str}``, else None."""
    if not isinstance(value, dict) or not isinstance(name := value.get("name"), str) or not name:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(new_call_id(), name, arguments)


def _partial_suffix(text: str, tag: str) -> int:
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


_decoder = json.JSONDecoder()


class ToolCallParser(abc.ABC):
    """Splits one answer's content into text and tool calls as it streams. Use once per request.

    ``feed`` returns the text that is surely content, and the calls completed by this piece; ``flush``
    what is left at the end. Subclasses say where calls start and how the held text parses.
    """

    #: Whether the format's markers are special tokens, which detokenizing must keep for the parser.
    needs_special_tokens: bool = False

    def __init__(self) -> None:
        self._held = ""

    @abc.abstractmethod
    def feed(self, text: str) -> tuple[str, list[ToolCall]]: ...

    @abc.abstractmethod
    def flush(self) -> tuple[str, list[ToolCall]]: ...


class HermesParser(ToolCallParser):
    """``<tool_call>{json}</tool_call>``: content passes through, each call is held until it closes."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._in_call = False
        self._after_call = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        text = self._held + text
        self._held = ""
        content: list[str] = []
        calls: list[ToolCall] = []
        while text:
            if self._in_call:
                end = text.find(self.END)
                if end < 0:
                    self._held = text
                    break
                body, text = text[:end], text[end + len(self.END) :]
                self._in_call = False
                self._take(self.START + body + self.END, body, content, calls)
                continue
            start = text.find(self.START)
            if start < 0:
                keep = _partial_suffix(text, self.START)
                shown = text[: len(text) - keep]
                self._held = text[len(shown) :]
                content.append(self._between_calls(shown))
                break
            content.append(self._between_calls(text[:start]))
            text = text[start + len(self.START) :]
            self._in_call = True
        return "".join(content), calls

    def flush(self) -> tuple[str, list[ToolCall]]:
        held, self._held = self._held, ""
        if not self._in_call:
            return self._between_calls(held), []
        self._in_call = False
        content: list[str] = []
        calls: list[ToolCall] = []
        self._take(self.START + held, held, content, calls)  # a call cut off before its closing tag
        return "".join(content), calls

    def _take(self, raw: str, body: str, content: list[str], calls: list[ToolCall]) -> None:
        try:
            call = _call_from(json.loads(body))
        except ValueError:
            call = None
        if call is None:
            content.append(raw)
        else:
            calls.append(call)
            self._after_call = True  # until text follows

    def _between_calls(self, text: str) -> str:
        # Models put newlines between and after calls: the whitespace right after a call is dropped,
        # up to the next text (whose own spaces, in later pieces, are kept).
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        return text


class _WholeAnswerParser(ToolCallParser):
    """Formats whose calls run to the end of the answer once their marker appears: hold from there."""

    def __init__(self) -> None:
        super().__init__()
        self._holding = False
        self._seen_text = False

    @abc.abstractmethod
    def _marker_at(self, text: str) -> tuple[int, int]:
        """Where calls start in ``text`` (-1: not here), and how much of its end may be a marker's start."""

    @abc.abstractmethod
    def _parse(self, held: str) -> list[ToolCall] | None:
        """The calls in the text held from the marker on; None when it does not parse as calls."""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self._holding:
            self._held += text
            return "", []
        text = self._held + text
        self._held = ""
        start, keep = self._marker_at(text)
        if start >= 0:
            self._holding = True
            self._held = text[start:]
            return text[:start], []
        shown = text[: len(text) - keep]
        self._held = text[len(shown) :]
        return shown, []

    def flush(self) -> tuple[str, list[ToolCall]]:
        held, self._held = self._held, ""
        if not self._holding:
            return held, []
        calls = self._parse(held)
        return ("", calls) if calls else (held, [])


class Llama3JsonParser(_WholeAnswerParser):
    """A Llama 3 answer that opens with ``<|python_tag|>`` or ``{`` is held whole and parsed as calls."""

    TAG = "<|python_tag|>"
    needs_special_tokens = True

    def _marker_at(self, text: str) -> tuple[int, int]:
        if self._seen_text:
            return -1, 0  # only the opening of the answer counts
        stripped = text.lstrip()
        if not stripped:
            return -1, len(text)
        if stripped.startswith((self.TAG, "{")):
            return len(text) - len(stripped), 0
        if self.TAG.startswith(stripped):
            return -1, len(text)
        self._seen_text = True
        return -1, 0

    def _parse(self, held: str) -> list[ToolCall] | None:
        text = held.strip().removeprefix(self.TAG).strip()
        calls: list[ToolCall] = []
        while text:
            try:
                value, end = _decoder.raw_decode(text)
            except ValueError:
                return None
            call = _call_from(value)
            if call is None:
                return None
            calls.append(call)
            text = text[end:].lstrip()
            text = text.removeprefix(";").lstrip()
        return calls


class MistralParser(_WholeAnswerParser):
    """From ``[TOOL_CALLS]`` to the end: a JSON list of calls, or ``name[ARGS]{json}`` per call."""

    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
    needs_special_tokens = True

    def _marker_at(self, text: str) -> tuple[int, int]:
        index = text.find(self.TAG)
        return (index, 0) if index >= 0 else (-1, _partial_suffix(text, self.TAG))

    def _parse(self, held: str) -> list[ToolCall] | None:
        parts = [part.strip() for part in held.split(self.TAG)[1:]]
        calls: list[ToolCall] = []
        for part in parts:
            if part.startswith(("[", "{")):
                try:
                    value, _ = _decoder.raw_decode(part)
                except ValueError:
                    return None
                for item in value if isinstance(value, list) else [value]:
                    if (call := _call_from(item)) is None:
                        return None
                    calls.append(call)
            else:
                name, marker, arguments = part.partition(self.ARGS)
                if not marker or not name.strip():
                    return None
                try:
                    value, _ = _decoder.raw_decode(arguments.strip())
                except ValueError:
                    return None
                calls.append(ToolCall(new_call_id(), name.strip(), json.dumps(value, ensure_ascii=False)))
        return calls or None


TOOL_CALL_PARSERS: Final[dict[str, Callable[[], ToolCallParser]]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def tool_call_parser(name: str) -> ToolCallParser:
    """A new parser of the kind ``name``; raises KeyError for an unknown name (checked at start-up)."""
    return TOOL_CALL_PARSERS[name]()
