"""The router seam: what every router of a model pool offers, and the decision it returns.

A router is created per model pool by the model watcher (frontend_gateway/models/watcher.py) from
``RouterSettings``, started when the pool is built and closed when it goes. The engine that forwards
requests (frontend_gateway/models/remote_engines.py) asks it to ``choose`` an instance for each attempt at a
request, and tells it when that attempt's prefill is done (its first output) and when it is over
(``finished``: exactly once per decision, whether the stream ended, failed, was cancelled or is about
to be migrated), so that a router can track the load it put on each worker.

``choose`` is a pure decision over the router's own state: no I/O, no awaiting, so that it is cheap
and testable. Routers that learn from the network (the KV router) do that I/O in tasks they start in
``start`` and stop in ``close``.
"""

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from frontend_gateway.routing.disagg_policy import DisaggPolicy
from runtime.cluster.addressing import EndpointAddress
from runtime.fleet_contract.request_records import RouteChoice
from runtime.fleet_contract.router_settings import (
    DEFAULT_DISK_HIT_WEIGHT,
    DEFAULT_HOST_HIT_WEIGHT,
    DEFAULT_QUEUED_PREFILL_WEIGHT,
)
from runtime.protocol import PreprocessedRequest, TextRequest

#: Defaults of the KV router's settings (the flags of launcher/cli.py show them too).
DEFAULT_OVERLAP_SCORE_WEIGHT = 1.0
DEFAULT_PREDICTED_TTL_S = 120.0
# Entries (block, worker) the predicting indexer keeps: 16 workers' worth of 16k blocks each, ~50 MB at most.
DEFAULT_PREDICTED_MAX_BLOCKS = 1 << 18


class RouterMode(enum.StrEnum):
    RANDOM = "random"
    ROUND_ROBIN = "round-robin"
    KV = "kv"


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    """A routable instance: its id, the subject it listens on, and the endpoint it serves (None: the
    pool's first instance's; the KV router hears each component's events on that component's subjects)."""

    instance_id: int
    subject: str
    address: EndpointAddress | None = None
    #: Where the instance embeds text, if its engine does (``ModelEntry.embed_subject``).
    embed_subject: str | None = None
    #: Whether its engine publishes KV events (``ModelEntry.kv_events``); a KV router predicts the cache of
    #: one that does not from its own decisions.
    kv_events: bool = True
    #: Prompt tokens its engine computes in one step (``ModelEntry.prefill_token_capacity``), if it says.
    prefill_token_capacity: int | None = None

    @property
    def name(self) -> str:
        return f"{self.instance_id:x}"


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes, and what the router expects it to cost there.

    ``overlap_blocks`` is the number of the prompt's leading blocks the router believes the worker
    already holds; ``prefill_tokens`` the prompt tokens it will still have to compute. ``dp_rank``
    is the data-parallel rank of the instance to use, or None to let the engine pick.
    """

    instance: InstanceInfo
    dp_rank: int | None = None
    overlap_blocks: int = 0
    prefill_tokens: int = 0
    #: For the request log: the router's mode, and (the KV router) the prompt's blocks, the chosen worker's cost
    #: and how many workers were weighed; None where the router does not weigh. An account of the decision, not
    #: the decision: left out of comparisons.
    mode: str = field(default="", compare=False)
    prompt_blocks: int | None = field(default=None, compare=False)
    cost: float | None = field(default=None, compare=False)
    candidates: int | None = field(default=None, compare=False)

    def choice(self) -> RouteChoice:
        """The decision as a request record tells it (runtime/fleet_contract/request_records.py)."""
        weighed = self.cost is not None
        return RouteChoice(
            mode=self.mode,
            instance_id=self.instance.instance_id,
            dp_rank=self.dp_rank,
            overlap_blocks=self.overlap_blocks if weighed else None,
            prompt_blocks=self.prompt_blocks,
            cost=self.cost,
            candidates=self.candidates,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterSettings:
    """How the model watcher builds each pool's router (the ``--router-*`` flags)."""

    mode: RouterMode = RouterMode.ROUND_ROBIN
    #: Weight of the prefill work still to do (in blocks) against the decode blocks already active.
    overlap_score_weight: float = DEFAULT_OVERLAP_SCORE_WEIGHT
    #: Weight of the prompt tokens already in flight to a worker against the request's own prefill (the
    #: default, shared with pipelines' settings, is explained in runtime/fleet_contract/tasks.py).
    queued_prefill_weight: float = DEFAULT_QUEUED_PREFILL_WEIGHT
    #: 0: always the cheapest worker; above: sample from a softmax over normalised costs.
    temperature: float = 0.0
    #: True: learn caches from the workers' KV events; False: predict them from the router's own decisions.
    use_kv_events: bool = True
    #: Credit of a prompt block a worker keeps in host memory, and on a disk or outside the node, against one
    #: on its device (routing/kv_scoring.py).
    host_hit_weight: float = DEFAULT_HOST_HIT_WEIGHT
    disk_hit_weight: float = DEFAULT_DISK_HIT_WEIGHT
    predicted_ttl_s: float = DEFAULT_PREDICTED_TTL_S
    predicted_max_blocks: int = DEFAULT_PREDICTED_MAX_BLOCKS
    #: A worker whose KV cache is this full (0..1), or has this many requests waiting, takes no new
    #: request; when every worker of a pool is busy the gateway answers 503 (None: no such threshold).
    busy_kv_usage: float | None = None
    busy_waiting: int | None = None
    #: Share decisions with the pool's routers in other ingress processes (routing/replica_sync.py).
    replica_sync: bool = False
    #: Where prompts are computed when a model has prefill workers (routing/disagg_policy.py).
    disagg: DisaggPolicy = field(default_factory=DisaggPolicy)
    seed: int | None = None  # for tests: repeatable random choices

    def __post_init__(self) -> None:
        # Checked here too, not only by the flags: a bad value from code must not route silently wrong.
        if not self.overlap_score_weight >= 0.0:
            raise ValueError(f"overlap_score_weight must be >= 0, not {self.overlap_score_weight}")
        if not 0.0 <= self.queued_prefill_weight <= 1.0:
            raise ValueError(f"queued_prefill_weight must be between 0 and 1, not {self.queued_prefill_weight}")
        for name in ("host_hit_weight", "disk_hit_weight"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1, not {getattr(self, name)}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, not {self.temperature}")
        if not self.predicted_ttl_s > 0.0:
            raise ValueError(f"predicted_ttl_s must be > 0, not {self.predicted_ttl_s}")
        if self.predicted_max_blocks < 1:
            raise ValueError(f"predicted_max_blocks must be >= 1, not {self.predicted_max_blocks}")
        if self.busy_kv_usage is not None and not 0.0 < self.busy_kv_usage <= 1.0:
            raise ValueError(f"busy_kv_usage must be above 0 and at most 1, not {self.busy_kv_usage}")
        if self.busy_waiting is not None and self.busy_waiting < 1:
            raise ValueError(f"busy_waiting must be >= 1, not {self.busy_waiting}")


class Router(Protocol):
    """Chooses among a model pool's instances and tracks what it sent where."""

    async def start(self) -> None:
        """Begin listening for what the router learns from (nothing for the basic routers)."""
        ...

    async def close(self) -> None:
        """Stop every task ``start`` began; the router is not used afterwards."""
        ...

    def choose(self, request: PreprocessedRequest | TextRequest, candidates: Sequence[InstanceInfo]) -> Decision | None:
        """Where ``request`` goes among ``candidates`` (in a stable order), or None when there is none.

        Never blocks and does no I/O. Every Decision returned must be followed by one ``finished``.
        """
        ...

    def prefill_done(self, request_id: str) -> None:
        """The chosen worker sent its first output: the prompt is computed (no-op for unknown ids)."""
        ...

    def finished(self, request_id: str) -> None:
        """The attempt ``choose`` decided is over, however it ended (no-op for unknown ids)."""
        ...

    def kv_usage(self, instance_id: int, dp_rank: int | None) -> float | None:
        """How full the instance's (rank's) KV cache is, 0..1, as far as the router knows; None: it does not."""
        ...

    def busy(self, instance_id: int) -> bool:
        """Whether the instance is past a busy threshold and should take no new request (every dp rank)."""
        ...

    def instance_added(self, instance: InstanceInfo) -> None:
        """A new instance joined the pool (the KV router asks it for its cache)."""
        ...

    def instance_removed(self, instance_id: int) -> None:
        """An instance left the pool: forget what is known about it."""
        ...
