"""What the operator asks of a pipeline's planner: latency targets, bounds, and how steady it must be.

Targets are given for the pipeline (``Targets.default``) and may be overridden per group (``Targets.groups``,
by role). Everything here is plain data, validated on construction; the control plane stores it and passes it
to ``Planner.decide`` on every interval.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from planner.errors import SettingsError

#: A worker group's role in its pipeline, as the control plane names it (WorkerGroup.Role's values).
Role = Literal["aggregated", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("aggregated", "prefill", "decode")

#: How the next interval's load is predicted (predict.py): the last value, or a damped linear trend.
PredictorName = Literal["constant", "trend"]


@dataclass(frozen=True)
class GroupTargets:
    """Latency targets and replica bounds of one group (or of every group, as ``Targets.default``).

    ``ttft_s`` and ``itl_s`` are targets in seconds at ``percentile`` (90: p90); None: no target, and then SLA
    sizing of the phase it governs is not possible (load mode is used).
    """

    ttft_s: float | None = None
    itl_s: float | None = None
    percentile: float = 90.0
    min_replicas: int = 1
    max_replicas: int = 8

    def __post_init__(self) -> None:
        for name, value in (("ttft_s", self.ttft_s), ("itl_s", self.itl_s)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise SettingsError(f"{name} must be a positive number of seconds, not {value!r}", field=name)
        if not 0 < self.percentile < 100:
            raise SettingsError(
                f"percentile must be between 0 and 100 (exclusive), not {self.percentile!r}", field="percentile"
            )
        if self.min_replicas < 0:
            raise SettingsError(f"min_replicas must be 0 or more, not {self.min_replicas}", field="min_replicas")
        if self.max_replicas < max(self.min_replicas, 1):
            raise SettingsError(
                f"max_replicas ({self.max_replicas}) must be at least min_replicas ({self.min_replicas}) and 1",
                field="max_replicas",
            )


@dataclass(frozen=True)
class LoadThresholds:
    """Load mode's thresholds, per replica (the reference's "simple" mode).

    A group scales up by one when any replica is over an "up" threshold, and down by one when every replica
    is under its "down" threshold and the load of the one removed would not push the rest over "up".
    Prefill work is judged by queued prompt tokens, decode work by the share of KV blocks in use; an
    aggregated group by both.
    """

    prefill_queue_up_tokens: float = 8192.0
    prefill_queue_down_tokens: float = 512.0
    kv_usage_up: float = 0.8
    kv_usage_down: float = 0.4

    def __post_init__(self) -> None:
        if not 0 <= self.prefill_queue_down_tokens < self.prefill_queue_up_tokens:
            raise SettingsError(
                "prefill_queue_down_tokens must be 0 or more and under prefill_queue_up_tokens "
                f"({self.prefill_queue_down_tokens} vs {self.prefill_queue_up_tokens})",
                field="prefill_queue_down_tokens",
            )
        if not 0 <= self.kv_usage_down < self.kv_usage_up <= 1:
            raise SettingsError(
                f"need 0 <= kv_usage_down < kv_usage_up <= 1 (got {self.kv_usage_down} and {self.kv_usage_up})",
                field="kv_usage_down",
            )


#: The most standard errors ``Stability.noise_tolerance`` may ask for: past 3, a group trails a ramp by seconds.
MAX_NOISE_TOLERANCE = 3.0


@dataclass(frozen=True)
class Stability:
    """How the planner avoids flapping.

    * ``scale_down_margin``: a group shrinks only when its load fits in one replica fewer with this share to
      spare (0.15: the remaining replicas would be at most 85% busy).
    * ``cooldown_s``: after a group changes, it holds for this long (a new replica needs time to start and
      take load before it shows in the measurements).
    * ``reversal_s``: at least this long between a change and one in the opposite direction.
    * ``down_window_s``: a group shrinks only to the most replicas its load asked for over this window (as
      Kubernetes' HPA stabilization window): one quiet interval in noisy traffic does not remove a replica.
    * ``max_step_down``: replicas removed per decision at most (each removal drains its requests first).
    * ``noise_tolerance``: SLA mode grows a group only when the need is over its replicas by more than this many
      standard errors of the predicted request rate (arrivals counted over an interval are Poisson: at 2.5
      requests/s over 3 s, ±36%). 0: as soon as the predicted need is over. A latency over its target still grows
      the group through the profile's correction, whatever the noise.
    """

    scale_down_margin: float = 0.15
    cooldown_s: float = 60.0
    reversal_s: float = 60.0
    down_window_s: float = 180.0
    max_step_down: int = 1
    noise_tolerance: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.scale_down_margin < 1:
            raise SettingsError(
                f"scale_down_margin must be in [0, 1), not {self.scale_down_margin}", field="scale_down_margin"
            )
        for name in ("cooldown_s", "reversal_s", "down_window_s"):
            if getattr(self, name) < 0:
                raise SettingsError(f"{name} must be 0 or more seconds", field=name)
        if self.max_step_down < 1:
            raise SettingsError(f"max_step_down must be 1 or more, not {self.max_step_down}", field="max_step_down")
        if not 0 <= self.noise_tolerance <= MAX_NOISE_TOLERANCE:
            raise SettingsError(
                f"noise_tolerance must be in [0, {MAX_NOISE_TOLERANCE:g}] standard errors, not {self.noise_tolerance}",
                field="noise_tolerance",
            )


@dataclass(frozen=True)
class Targets:
    """A pipeline's planner settings.

    ``gpu_budget`` bounds the GPUs of all its groups together (GPUs per replica times replicas, summed);
    None: no budget. ``enabled`` off: the planner decides nothing (every decision holds, saying so).
    ``advisory``: decisions are made and recorded, and the caller acts on none of them.
    """

    default: GroupTargets = field(default_factory=GroupTargets)
    groups: Mapping[Role, GroupTargets] = field(default_factory=dict)
    gpu_budget: int | None = None
    enabled: bool = True
    advisory: bool = False
    predictor: PredictorName = "trend"
    load: LoadThresholds = field(default_factory=LoadThresholds)
    stability: Stability = field(default_factory=Stability)

    def __post_init__(self) -> None:
        if self.gpu_budget is not None and self.gpu_budget < 0:
            raise SettingsError(f"gpu_budget must be 0 or more GPUs, not {self.gpu_budget}", field="gpu_budget")
        for role in self.groups:
            if role not in ROLES:
                raise SettingsError(f"unknown group role {role!r} (one of {', '.join(ROLES)})", field=f"groups.{role}")
        if self.predictor not in ("constant", "trend"):
            raise SettingsError(f"unknown predictor {self.predictor!r} (constant or trend)", field="predictor")

    def for_group(self, role: Role) -> GroupTargets:
        """The targets of ``role``'s group: its own, or the pipeline's."""
        return self.groups.get(role, self.default)
