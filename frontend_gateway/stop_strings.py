"""Stop strings over a stream of text pieces.

A stop string can span several pieces ("Hel" + "lo" for "Hello"), so text that could be the start
of a stop string is held back until the next piece settles it. The stop string itself is never
shown to the client, as in the OpenAI API.
"""


class StopStringMatcher:
    """Feed text pieces; get back what may be shown now and whether a stop string was hit."""

    __slots__ = ("_held", "_stops")

    def __init__(self, stops: list[str]) -> None:
        self._stops = [stop for stop in stops if stop]
        self._held = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """Return (text safe to emit, True if a stop string ended the stream)."""
        text = self._held + piece
        first = -1
        for stop in self._stops:
            at = text.find(stop)
            if at != -1 and (first == -1 or at < first):
                first = at
        if first != -1:
            self._held = ""
            return text[:first], True
        hold = 0
        for stop in self._stops:
            # The longest tail of ``text`` that is a proper prefix of this stop string.
            for size in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:size]):
                    hold = size
                    break
        if hold:
            self._held = text[-hold:]
            return text[:-hold], False
        self._held = ""
        return text, False

    def flush(self) -> str:
        """Return the held-back text once the stream has ended without a stop string."""
        held, self._held = self._held, ""
        return held
