"""What a model pool's routing tells whoever watches its health (the gateway's Prometheus metrics).

Every method is called on the request path or the router's listening path, so an implementation
must be cheap and must not block: it counts, it does not log or wait.
"""

from typing import Protocol

from frontend_gateway.routing.kv_subscriber import KvSubscriberHealth


class RoutingHealth(KvSubscriberHealth, Protocol):
    """The KV event subscriber's repairs (gaps, stale batches, state syncs, malformed messages), the KV
    router's decisions, and what the remote engines saw go wrong."""

    def chosen(self, overlap_blocks: int, prompt_blocks: int, cost_spread: float) -> None:
        """The KV router chose a worker holding ``overlap_blocks`` of the prompt's ``prompt_blocks`` full
        blocks; the candidates' costs spread over ``cost_spread`` blocks (highest minus lowest; 0 with one
        candidate)."""
        ...

    def busy_refusal(self) -> None:
        """A request was refused because every instance was busy (503 ``all_workers_busy``)."""
        ...

    def migration(self, cause: str) -> None:
        """A request moved to another instance after its stream broke for ``cause`` (``StreamBroken.cause``)."""
        ...

    def disagg_decision(self, path: str, reason: str) -> None:
        """A request of a model with prefill workers had its prompt computed on one (``path`` "remote") or where
        it decodes ("local"), for ``reason`` (disagg_policy.py, models/remote_engines.py)."""
        ...

    def deadline_expired(self, deadline: str) -> None:
        """A stream passed one of the request plane's deadlines (``progress``: no output in time)."""
        ...

    def replica_sync_delay(self, seconds: float) -> None:
        """A batch of another router replica's decisions arrived ``seconds`` after it was sent
        (``--router-replica-sync``): decisions this late are routed around blind."""
        ...
