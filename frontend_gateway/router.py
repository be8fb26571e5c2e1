"""Routing: which instance of a model takes a request.

The decision is a pure function of the request, a snapshot of the candidate instances and the
router's own state, kept apart from the I/O that acts on it, so that it is easy to test and so that
KV-aware routing can later be one more mode here.
"""

import enum
import random
from collections.abc import Sequence
from dataclasses import dataclass

from runtime.protocol import PreprocessedRequest, TextRequest


class RouterMode(enum.StrEnum):
    RANDOM = "random"
    ROUND_ROBIN = "round-robin"


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    """A routable instance: its id and the subject it listens on."""

    instance_id: int
    subject: str

    @property
    def name(self) -> str:
        return f"{self.instance_id:x}"


class Router:
    """Chooses among a model's instances; ``choose`` never blocks and does no I/O."""

    def __init__(self, mode: RouterMode, *, seed: int | None = None) -> None:
        self.mode = mode
        self._turn = 0
        self._rng = random.Random(seed)

    def choose(
        self, request: PreprocessedRequest | TextRequest, candidates: Sequence[InstanceInfo]
    ) -> InstanceInfo | None:
        """The instance for ``request``, or None when there is none. Candidates are in a stable order."""
        if not candidates:
            return None
        if self.mode is RouterMode.RANDOM:
            return self._rng.choice(candidates)
        self._turn += 1
        return candidates[self._turn % len(candidates)]
