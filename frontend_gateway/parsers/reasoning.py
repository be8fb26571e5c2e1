"""Reasoning parsers: split ``<think>…</think>`` from the answer, into ``reasoning_content``.

The names are vLLM's (``--reasoning-parser``), and so is what each does:

* ``deepseek_r1``: the output is reasoning from its first token until ``</think>``. DeepSeek-R1's chat
  template ends the prompt with ``<think>\\n``, so the model never writes the opening tag (one it
  writes anyway is dropped); an answer cut off before ``</think>`` is all reasoning.
* ``qwen3``: reasoning only when the output opens with ``<think>`` (Qwen3 writes the tag itself, and
  with thinking switched off in its template writes none): anything else is all content.

Whitespace between ``</think>`` and the answer is dropped, as the models put a blank line there.
"""

from typing import Final

__all__ = ["REASONING_PARSERS", "ReasoningParser", "reasoning_parser"]


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` are a proper prefix of ``tag`` (to hold back)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ReasoningParser:
    """Splits one answer's text into (reasoning, content) as it streams. Use once per request."""

    __slots__ = ("_end", "_held", "_start", "_starts_in_reasoning", "_state")

    _OPENING, _REASONING, _AFTER_END, _CONTENT = range(4)

    def __init__(self, *, start: str, end: str, starts_in_reasoning: bool) -> None:
        self._start = start
        self._end = end
        self._starts_in_reasoning = starts_in_reasoning
        self._state = self._OPENING
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the content that ``text`` (with what was held back) completes."""
        reasoning = ""
        text = self._held + text
        self._held = ""
        if self._state == self._OPENING:
            stripped = text.lstrip()
            if stripped.startswith(self._start):
                text = stripped[len(self._start) :]
                self._state = self._REASONING
            elif self._start.startswith(stripped):
                self._held = text  # empty, or the opening tag so far
                return "", ""
            else:
                self._state = self._REASONING if self._starts_in_reasoning else self._CONTENT
        if self._state == self._REASONING:
            index = text.find(self._end)
            if index < 0:
                keep = _partial_suffix(text, self._end)
                if keep:
                    self._held = text[-keep:]
                    text = text[:-keep]
                return text, ""
            reasoning, text = text[:index], text[index + len(self._end) :]
            self._state = self._AFTER_END
        if self._state == self._AFTER_END:
            text = text.lstrip()
            if not text:
                return reasoning, ""
            self._state = self._CONTENT
        return reasoning, text

    def flush(self) -> tuple[str, str]:
        """What was held back at the end of the answer: an unfinished tag is text after all."""
        held, self._held = self._held, ""
        if self._state == self._REASONING or (self._state == self._OPENING and self._starts_in_reasoning):
            return held, ""
        return "", held if self._state != self._AFTER_END else ""


def _deepseek_r1() -> ReasoningParser:
    return ReasoningParser(start="<think>", end="</think>", starts_in_reasoning=True)


def _qwen3() -> ReasoningParser:
    return ReasoningParser(start="<think>", end="</think>", starts_in_reasoning=False)


REASONING_PARSERS: Final = {"deepseek_r1": _deepseek_r1, "qwen3": _qwen3}


def reasoning_parser(name: str) -> ReasoningParser:
    """A new parser of the kind ``name``; raises KeyError for an unknown name (checked at start-up)."""
    return REASONING_PARSERS[name]()
