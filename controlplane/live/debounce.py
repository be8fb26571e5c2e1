"""Which elements a socket renders next, and when: a burst of changes to one element is one render.

The first change of an element is due at once; changes within ``window`` seconds of its last render
are due together at the end of that window. Times are the caller's (the event loop's clock), so the
rules are tested without waiting.
"""

from collections.abc import Hashable
from typing import Generic, TypeVar

Key = TypeVar("Key", bound=Hashable)


class PendingRenders(Generic[Key]):
    """The elements waiting for a render, with the time each becomes due."""

    def __init__(self, window: float) -> None:
        self.window = window
        self._due: dict[Key, float] = {}
        self._changed_at: dict[Key, float] = {}  # of the latest change of each pending key
        self._rendered_at: dict[Key, float] = {}

    def __len__(self) -> int:
        return len(self._due)

    def add(self, key: Key, now: float) -> None:
        """``key`` changed at ``now``."""
        self._changed_at[key] = now
        if key in self._due:
            return  # its render is coming and will show this change too
        last = self._rendered_at.get(key)
        self._due[key] = now if last is None else max(now, last + self.window)

    def next_due(self) -> float | None:
        """When the earliest pending render is due (None: nothing pending)."""
        return min(self._due.values(), default=None)

    def take_due(self, now: float) -> list[tuple[Key, float]]:
        """The keys due at ``now`` with the time of their latest change, in the order they first changed;
        they count as rendered at ``now``."""
        due = [(key, self._changed_at.pop(key)) for key, at in self._due.items() if at <= now]
        for key, _ in due:
            del self._due[key]
            self._rendered_at[key] = now
        # Forget renders older than a window: a change now would be due at once anyway.
        if len(self._rendered_at) > 2 * len(due) + 64:
            self._rendered_at = {key: at for key, at in self._rendered_at.items() if at + self.window > now}
        return due
