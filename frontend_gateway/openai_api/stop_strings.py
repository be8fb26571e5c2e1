"""Stop strings over a stream of text pieces.

A stop string can span several pieces ("Hel" + "lo" for "Hello"), so text that could be the start
of a stop string is held back until the next piece settles it. The stop string itself is not shown to
the client, as in the OpenAI API, unless asked for (vLLM's ``include_stop_str_in_output``).

Before ``min_tokens`` tokens are generated no stop string ends the stream (vLLM's rule): the text of
those tokens is fed with ``may_stop=False``, and a stop string counts only if it ends in text fed
afterwards (it may begin earlier, as in vLLM, which searches back from the new text).
"""


class StopStringMatcher:
    """Feed text pieces; get back what may be shown now and whether a stop string was hit."""

    __slots__ = ("_held", "_include", "_settled", "_stops")

    def __init__(self, stops: list[str], *, include: bool = False) -> None:
        self._stops = [stop for stop in stops if stop]
        # include_stop_str_in_output: the stop string is shown, as the end of the text.
        self._include = include
        self._held = ""
        # How many leading characters of the held text no stop string may end in (fed with may_stop=False).
        self._settled = 0

    def feed(self, piece: str, *, may_stop: bool = True) -> tuple[str, bool]:
        """Return (text safe to emit, True if a stop string ended the stream).

        ``may_stop=False``: ``piece`` belongs to the first ``min_tokens`` tokens, where no stop string ends.
        """
        text = self._held + piece
        if may_stop:
            settled = self._settled
            first, end = -1, -1
            for stop in self._stops:
                at = text.find(stop, max(0, settled - len(stop) + 1))
                if at != -1 and (first == -1 or at < first):
                    first, end = at, at + len(stop)
            if first != -1:
                self._held, self._settled = "", 0
                return text[: end if self._include else first], True
        else:
            settled = len(text)
        hold = 0
        for stop in self._stops:
            # The longest tail of ``text`` that is a proper prefix of this stop string.
            for size in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:size]):
                    hold = size
                    break
        if hold:
            self._held = text[-hold:]
            self._settled = max(0, settled - (len(text) - hold))
            return text[:-hold], False
        self._held, self._settled = "", 0
        return text, False

    def flush(self) -> str:
        """Return the held-back text once the stream has ended without a stop string."""
        held, self._held, self._settled = self._held, "", 0
        return held
