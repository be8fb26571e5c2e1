"""Tool-call parsers: find the calls a model writes into its text, by the model's own format.

The names are vLLM's (``--tool-call-parser``):

* ``hermes``: ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``, any number, text around them
  is content (Hermes 2/3, Qwen 2.5/3 and others trained on that format).
* ``llama3_json``: the whole answer is ``{"name": …, "parameters": {…}}``, optionally after
  ``<|python_tag|>``, several separated by ``;`` (Llama 3.1/3.2 with JSON tool calling). An answer
  that does not open with ``{`` or the tag is content.
* ``mistral``: ``[TOOL_CALLS]`` followed by a JSON list of ``{"name", "arguments"}`` (or, from
  Mistral's v11 tokenizer on, ``name[ARGS]{…}`` per call); text before it is content.

Calls stream as vLLM's parsers stream them: a call's first piece carries its index, id and name (once
the model has written its name and opened its arguments), and the following pieces carry its arguments
as the model writes them, so that the pieces' arguments put together are exactly the call's arguments
(the JSON text the model wrote). A call written in another order (its arguments before its name, or
arguments that are a JSON string) is sent whole once its object closes. Text that looked like a call but
does not parse as one is given back as content, never dropped; a call cut off (``max_tokens``) keeps the
arguments written so far, in a stream and in a whole answer alike.
"""

import abc
import re
from collections.abc import Callable
from typing import Final

from frontend_gateway.parsers.calls import CallPiece, ToolCall, new_call_id, whole_piece
from frontend_gateway.parsers.json_calls import CallObject, JsonSpan

__all__ = ["TOOL_CALL_PARSERS", "CallPiece", "ToolCall", "ToolCallParser", "new_call_id", "tool_call_parser"]


def _partial_suffix(text: str, tag: str) -> int:
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ToolCallParser(abc.ABC):
    """Splits one answer's content into text and tool-call pieces as it streams. Use once per request.

    ``feed`` returns the text that is surely content, and the call pieces this text completes; ``flush``
    what is left at the end. Subclasses say where calls start and how the held text parses.
    """

    #: Whether the format's markers are special tokens, which detokenizing must keep for the parser.
    needs_special_tokens: bool = False

    def __init__(self) -> None:
        self._held = ""
        self._count = 0  # calls found so far: the next one's index

    @abc.abstractmethod
    def feed(self, text: str) -> tuple[str, list[CallPiece]]: ...

    @abc.abstractmethod
    def flush(self) -> tuple[str, list[CallPiece]]: ...

    def _object(self) -> CallObject:
        return CallObject(self._count, new_call_id())

    def _pieces(self, found: list[ToolCall]) -> list[CallPiece]:
        """Whole calls as pieces, numbered after those found before."""
        pieces = [whole_piece(self._count + number, call) for number, call in enumerate(found)]
        self._count += len(found)
        return pieces


class HermesParser(ToolCallParser):
    """``<tool_call>{json}</tool_call>``: content passes through, each call streams as it is written."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._body: str | None = None  # the text of the call being read (None: between calls)
        self._call: CallObject | None = None  # its JSON object, once it opened
        self._after_call = False

    def feed(self, text: str) -> tuple[str, list[CallPiece]]:
        text = self._held + text
        self._held = ""
        content: list[str] = []
        pieces: list[CallPiece] = []
        while text:
            if self._body is not None:
                end = text.find(self.END)
                if end < 0:
                    keep = _partial_suffix(text, self.END)
                    self._held = text[len(text) - keep :]
                    self._read(text[: len(text) - keep], pieces)
                    break
                self._read(text[:end], pieces)
                text = text[end + len(self.END) :]
                content.append(self._end_call(closed=True))
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
            self._body = ""
        return "".join(content), pieces

    def flush(self) -> tuple[str, list[CallPiece]]:
        held, self._held = self._held, ""
        if self._body is None:
            return self._between_calls(held), []
        pieces: list[CallPiece] = []
        self._read(held, pieces)
        return self._end_call(closed=False), pieces  # a call cut off before its closing tag

    def _read(self, text: str, pieces: list[CallPiece]) -> None:
        """Add ``text`` (inside a call) to the call; its object's pieces go to ``pieces``."""
        assert self._body is not None
        if self._call is None:
            body = self._body + text
            opened = body.lstrip()
            if opened.startswith("{"):
                self._call = self._object()
                pieces += self._call.feed(opened)
            self._body = body
            return
        self._body += text
        pieces += self._call.feed(text)

    def _end_call(self, *, closed: bool) -> str:
        """Finish the call being read; returns what of it is content (all of it, when it was no call)."""
        body, call = self._body or "", self._call
        self._body, self._call = None, None
        if call is not None and call.is_call:
            self._count += 1
            self._after_call = True  # until text follows
            return call.rest.strip()  # text after the object, inside the tags: not the call's
        return self.START + body + (self.END if closed else "")

    def _between_calls(self, text: str) -> str:
        # Models put newlines between and after calls: the whitespace right after a call is dropped,
        # up to the next text (whose own spaces, in later pieces, are kept).
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        return text


class _CallSequence(ToolCallParser):
    """Formats whose calls run to the end of the answer once their marker appears: from there on, JSON
    call objects (and, for Mistral, ``name[ARGS]{…}``) separated by what ``GAP`` matches.

    Once the marker is seen the parser reads, in turn, a gap (separators), a call, a gap… Text that is
    none of these ends the calls: with no call found yet, all the text from the marker on is content
    (it was not a call after all); after a call, the text from there on is.
    """

    GAP: re.Pattern[str]
    #: A marker that may come back between calls (held back while it is incomplete).
    REPEATED_TAG = ""
    #: The end of a text that may still become a gap (Mistral's ``[`` before its list's first ``{``).
    PENDING = re.compile("")
    NAMED_CALLS = False  # Mistral's ``name[ARGS]{…}``
    ARGS = "[ARGS]"

    def __init__(self) -> None:
        super().__init__()
        self._holding = False  # the marker was seen
        self._seen_text = False
        self._raw = ""  # all the text from the marker on (given back whole if no call comes)
        self._call: CallObject | None = None
        self._name: str | None = None  # a named call's name so far (Mistral)
        self._arguments: JsonSpan | None = None  # a named call's arguments, once they opened
        self._content = False  # the calls ended: the rest is content

    @abc.abstractmethod
    def _marker_at(self, text: str) -> tuple[int, int]:
        """Where calls start in ``text`` (-1: not here), and how much of its end may be a marker's start."""

    def feed(self, text: str) -> tuple[str, list[CallPiece]]:
        if self._content:
            return text, []
        if not self._holding:
            text = self._held + text
            self._held = ""
            start, keep = self._marker_at(text)
            if start < 0:
                shown = text[: len(text) - keep]
                self._held = text[len(shown) :]
                return shown, []
            self._holding = True
            before, text = text[:start], text[start:]
            content, pieces = self._calls(text)
            return before + content, pieces
        return self._calls(text)

    def flush(self) -> tuple[str, list[CallPiece]]:
        held, self._held = self._held, ""
        if not self._holding or self._content:
            return held, []
        if self._call is not None:
            if self._call.is_call:
                self._count += 1
                return "", []  # cut off: what was written was sent
            unread = self._call.raw
        elif self._arguments is not None:
            return "", []  # cut off: what was written was sent
        else:
            unread = (self._name or "") + held  # a name without its arguments, or a gap
            if not unread.strip() and self._count:
                return "", []
        return (unread if self._count else self._raw), []

    def _calls(self, text: str) -> tuple[str, list[CallPiece]]:
        """Read ``text`` (from the marker on) as calls; returns the content it ends in, and the pieces."""
        self._raw += text
        text = self._held + text
        self._held = ""
        pieces: list[CallPiece] = []
        while text:
            if self._call is not None:
                pieces += self._call.feed(text)
                if not self._call.closed:
                    return "", pieces
                call, self._call = self._call, None
                text = call.rest
                if not call.is_call:
                    return self._give_up(call.raw + text), pieces
                self._count += 1
            elif self._arguments is not None:
                end = self._arguments.end_in(text)
                pieces.append(CallPiece(self._count - 1, text[:end] if end >= 0 else text))
                if end < 0:
                    return "", pieces
                self._arguments, text = None, text[end:]
            elif self._name is not None:
                text = self._named(text, pieces)
                if self._content:
                    return text, pieces
            else:
                keep = _partial_suffix(text, self.REPEATED_TAG) if self.REPEATED_TAG else 0
                gap = self.GAP.match(text, 0, len(text) - keep)
                assert gap is not None  # the pattern matches the empty text
                rest = text[gap.end() :]
                if len(rest) <= keep or self.PENDING.fullmatch(rest):
                    self._held = rest
                    return "", pieces
                if rest.startswith("{"):
                    self._call, text = self._object(), rest
                elif self.NAMED_CALLS and (rest[0].isalnum() or rest[0] in "_-."):
                    self._name, text = "", rest
                else:
                    return self._give_up(rest), pieces
        return "", pieces

    def _named(self, text: str, pieces: list[CallPiece]) -> str:
        """Read a ``name[ARGS]`` call's head from ``text``; returns what is left of it to read."""
        assert self._name is not None
        head = self._name + text
        marker = head.find(self.ARGS)
        if marker < 0:
            keep = _partial_suffix(head, self.ARGS)
            if not re.fullmatch(r"[\w.\-]*", head[: len(head) - keep]):
                return self._give_up(head)
            self._name = head
            return ""
        name, after = head[:marker], head[marker + len(self.ARGS) :]
        value = after.lstrip()
        if not re.fullmatch(r"[\w.\-]+", name):
            return self._give_up(head)
        if not value:
            self._name = head  # the arguments have not opened yet
            return ""
        if value[0] not in "{[":
            return self._give_up(head)
        self._name = None
        self._arguments = JsonSpan()
        end = self._arguments.end_in(value)
        written = value[:end] if end >= 0 else value
        pieces.append(CallPiece(self._count, written, new_call_id(), name))
        self._count += 1
        if end < 0:
            return ""
        self._arguments = None
        return value[end:]

    def _give_up(self, text: str) -> str:
        """The calls end at ``text``: returns what becomes content (everything, if no call was found)."""
        self._content = True
        self._name = None
        return text if self._count else self._raw


class Llama3JsonParser(_CallSequence):
    """A Llama 3 answer that opens with ``<|python_tag|>`` or ``{`` is read as calls separated by ``;``."""

    TAG = "<|python_tag|>"
    GAP = re.compile(r"(?:\s|;|<\|python_tag\|>)*")
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


class MistralParser(_CallSequence):
    """From ``[TOOL_CALLS]`` to the end: a JSON list of calls, or ``name[ARGS]{json}`` per call."""

    TAG = "[TOOL_CALLS]"
    GAP = re.compile(r"(?:\s|,|\]|\[TOOL_CALLS\]|\[(?=\s*\{))*")
    REPEATED_TAG = TAG
    PENDING = re.compile(r"\[\s*")
    NAMED_CALLS = True
    needs_special_tokens = True

    def _marker_at(self, text: str) -> tuple[int, int]:
        index = text.find(self.TAG)
        return (index, 0) if index >= 0 else (-1, _partial_suffix(text, self.TAG))


TOOL_CALL_PARSERS: Final[dict[str, Callable[[], ToolCallParser]]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def tool_call_parser(name: str) -> ToolCallParser:
    """A new parser of the kind ``name``; raises KeyError for an unknown name (checked at start-up)."""
    return TOOL_CALL_PARSERS[name]()
