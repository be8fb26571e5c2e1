"""What the planner is told each interval: the pipeline's traffic and latency, and each group's replicas.

Callers build an ``Observation`` from the ingress's histograms and counters and the workers' load reports
(measure.py has the pure functions for that); the planner never reads a clock, a socket or a database.
"""

from dataclasses import dataclass, field

from planner.settings import Role


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica (instance) of a group, its dp ranks together.

    ``queued_prefill_tokens``: prompt tokens waiting to be computed there (None: not known).
    ``kv_usage``: share of its KV blocks in use, 0..1 (None: not reported).
    ``active_requests``: requests taken and not finished, the in-flight work a scale-down must drain.
    """

    instance_id: int
    active_requests: int = 0
    queued_prefill_tokens: float | None = None
    kv_usage: float | None = None


@dataclass(frozen=True)
class GroupObservation:
    """One worker group: ``replicas`` is the count the control plane holds now (desired, maybe still
    starting); ``loads`` has one entry per replica that reported load this interval."""

    role: Role
    replicas: int
    gpus_per_replica: int = 0
    loads: tuple[ReplicaLoad, ...] = ()

    @property
    def reporting(self) -> int:
        """Replicas that reported load (serving, or at least alive)."""
        return len(self.loads)

    @property
    def in_flight(self) -> int:
        """Requests in flight on the group's replicas."""
        return sum(load.active_requests for load in self.loads)


@dataclass(frozen=True)
class Observation:
    """The pipeline over the last interval (``interval_s`` seconds).

    ``request_rate`` is requests per second finished at the ingress; ``mean_isl``/``mean_osl`` the mean
    prompt and completion lengths in tokens (None: no request finished). ``ttft_s`` and ``itl_s`` are the
    measured latencies at ``percentile`` (None: nothing measured). ``prefix_hit_rate``: share of prompt
    tokens found cached, which prefill sizing does not have to compute (None: unknown, taken as 0).
    """

    interval_s: float
    request_rate: float
    mean_isl: float | None = None
    mean_osl: float | None = None
    percentile: float = 90.0
    ttft_s: float | None = None
    itl_s: float | None = None
    prefix_hit_rate: float | None = None
    groups: tuple[GroupObservation, ...] = field(default=())

    def group(self, role: Role) -> GroupObservation | None:
        """The observed group of ``role``, if the pipeline has one."""
        return next((group for group in self.groups if group.role == role), None)
