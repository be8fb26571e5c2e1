"""Routers that ignore caches and load: random and round-robin.

They keep no per-request state, so the notices of the router seam are no-ops for them.
"""

import random
from collections.abc import Sequence

from frontend_gateway.routing.protocol import Decision, InstanceInfo, RouterMode
from runtime.protocol import PreprocessedRequest, TextRequest


class _Stateless:
    """The lifecycle and notices of a router that learns nothing."""

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def prefill_done(self, request_id: str) -> None:
        return None

    def finished(self, request_id: str) -> None:
        return None

    def kv_usage(self, instance_id: int, dp_rank: int | None) -> float | None:
        return None  # it hears no load reports

    def busy(self, instance_id: int) -> bool:
        return False  # it knows nothing of the load; a worker's own limit still refuses

    def instance_added(self, instance: InstanceInfo) -> None:
        return None

    def instance_removed(self, instance_id: int) -> None:
        return None


def _decision(instance: InstanceInfo, request: PreprocessedRequest | TextRequest, mode: RouterMode) -> Decision:
    """A decision that expects no cache hit: the whole prompt is to compute."""
    prompt_tokens = len(request.token_ids) if isinstance(request, PreprocessedRequest) else 0
    return Decision(instance, prefill_tokens=prompt_tokens, mode=mode)


class RandomRouter(_Stateless):
    """Each request to an instance drawn uniformly at random."""

    def __init__(self, *, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: PreprocessedRequest | TextRequest, candidates: Sequence[InstanceInfo]) -> Decision | None:
        if not candidates:
            return None
        return _decision(self._rng.choice(candidates), request, RouterMode.RANDOM)


class RoundRobinRouter(_Stateless):
    """Each request to the next instance in the candidates' stable order."""

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, request: PreprocessedRequest | TextRequest, candidates: Sequence[InstanceInfo]) -> Decision | None:
        if not candidates:
            return None
        self._turn += 1
        return _decision(candidates[self._turn % len(candidates)], request, RouterMode.ROUND_ROBIN)
