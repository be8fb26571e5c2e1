"""Per-key concurrent requests: how many of one API key's requests an ingress process serves at once.

Without a cap, one key can take every generation slot of a process (and fill its queue) for as long as its
rate limit lets it send: at 600 requests a minute of long streams, within minutes. A key's cap is its
record's ``max_concurrent_requests``, else the process's ``--max-concurrent-per-key``, else none.

Counted in this process only, not through Redis: what it protects is this process's slots, and a count
shared across processes would need every process to give back what it took, which a crashed one does
not. A request holds its place from its key's check to its response's last byte (or its refusal): its body
being read, its wait in the admission queue and its generation included. Over the cap: 429
``concurrency_limit_exceeded`` with ``Retry-After: 1``.
"""

from http import HTTPStatus

from frontend_gateway.errors import GatewayError
from runtime.fleet_contract.api_keys import KeyRecord


class TooManyConcurrentRequests(GatewayError):
    """The key has as many requests in progress on this process as it may (429 with Retry-After)."""

    status = HTTPStatus.TOO_MANY_REQUESTS
    error_type = "requests"
    code = "concurrency_limit_exceeded"
    retry_after = 1


class KeyConcurrency:
    """Counts each key's requests in progress; ``enter`` before serving one, ``leave`` (exactly once) after."""

    __slots__ = ("_default", "_held")

    def __init__(self, default: int | None = None) -> None:
        #: The cap of a key whose record sets none (``--max-concurrent-per-key``); None: no cap.
        self._default = default
        self._held: dict[int, int] = {}  # key id -> requests in progress, for keys with a cap

    def held(self, key: KeyRecord) -> int:
        return self._held.get(key.key_id, 0)

    def enter(self, key: KeyRecord) -> bool:
        """Count a request of ``key``; returns whether it was counted (False: the key has no cap, and
        ``leave`` is not needed). Raises TooManyConcurrentRequests when the key is at its cap."""
        cap = key.max_concurrent_requests if key.max_concurrent_requests is not None else self._default
        if cap is None:
            return False
        held = self._held.get(key.key_id, 0)
        if held >= cap:
            raise TooManyConcurrentRequests(
                f"The API key {key.name!r} has {held} requests in progress on this server, its limit of "
                f"concurrent requests; retry once one has finished."
            )
        self._held[key.key_id] = held + 1
        return True

    def leave(self, key: KeyRecord) -> None:
        """A counted request of ``key`` is over."""
        held = self._held[key.key_id] - 1
        if held:
            self._held[key.key_id] = held
        else:
            del self._held[key.key_id]  # no entry left per key seen once
