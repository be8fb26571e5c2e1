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

__all__ = ["REASONING_PARSERS", "ReasoningCounter", "ReasoningParser", "reasoning_parser"]


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` are a proper prefix of ``tag`` (to hold back)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ReasoningParser:
    """Splits one answer's text into (reasoning, content) as it streams. Use once per request."""

    __slots__ = ("_end", "_held", "_reasoned", "_start", "_starts_in_reasoning", "_state")

    _OPENING, _REASONING, _AFTER_END, _CONTENT = range(4)

    def __init__(self, *, start: str, end: str, starts_in_reasoning: bool) -> None:
        self._start = start
        self._end = end
        self._starts_in_reasoning = starts_in_reasoning
        self._state = self._OPENING
        self._held = ""
        self._reasoned = False  # whether the answer had reasoning (so far)

    @property
    def reasoned(self) -> bool:
        """Whether the answer so far has reasoning in it (an unfinished opening tag aside)."""
        return self._reasoned

    @property
    def reasoning_over(self) -> bool:
        """Whether the rest of the answer is content: its reasoning ended, or it had none."""
        return self._state in (self._AFTER_END, self._CONTENT)

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
                self._reasoned = True
            elif self._start.startswith(stripped):
                self._held = text  # empty, or the opening tag so far
                return "", ""
            else:
                self._state = self._REASONING if self._starts_in_reasoning else self._CONTENT
                self._reasoned = self._starts_in_reasoning
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


class ReasoningCounter:
    """Counts an answer's reasoning tokens (``usage.completion_tokens_details.reasoning_tokens``) as it is
    generated: the tokens up to and with the one whose text ends the reasoning (its closing tag), or all of
    them when the answer ends still reasoning; 0 for an answer without reasoning.

    It reads the pieces where they are made, each with the count of tokens generated so far, with its own
    parser: whoever shows the answer may read it whole or in pieces, and would not know its tokens.
    """

    __slots__ = ("_parser", "tokens")

    def __init__(self, parser: "ReasoningParser") -> None:
        self._parser = parser
        self.tokens = 0

    def feed(self, text: str, tokens_so_far: int) -> None:
        """Read the next piece of the answer; ``tokens_so_far`` counts the tokens generated, its own included."""
        parser = self._parser
        if parser.reasoning_over:
            return
        parser.feed(text)
        if parser.reasoned:
            self.tokens = tokens_so_far


def _deepseek_r1() -> ReasoningParser:
    return ReasoningParser(start="<think>", end="</think>", starts_in_reasoning=True)


def _qwen3() -> ReasoningParser:
    return ReasoningParser(start="<think>", end="</think>", starts_in_reasoning=False)


REASONING_PARSERS: Final = {"deepseek_r1": _deepseek_r1, "qwen3": _qwen3}


def reasoning_parser(name: str) -> ReasoningParser:
    """A new parser of the kind ``name``; raises KeyError for an unknown name (checked at start-up)."""
    return REASONING_PARSERS[name]()
