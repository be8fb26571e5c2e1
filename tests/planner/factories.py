"""Small builders of the planner's inputs, with the defaults the tests mostly want."""

from planner import (
    GroupObservation,
    GroupTargets,
    LoadThresholds,
    Observation,
    Profile,
    ReplicaLoad,
    Stability,
    Targets,
)
from planner.settings import PredictorName, Role

#: Flat capacities, so that sizing is plain arithmetic: a prefill replica computes 10,000 prompt tokens/s
#: (10 req/s at ISL 1,000), a decode replica produces 1,000 tokens/s (10 req/s at OSL 100).
FLAT_PROFILE = {
    "version": 1,
    "prefill": {"ttft_s": 0.5, "points": [{"isl": 100, "tokens_per_s": 10000}, {"isl": 10000, "tokens_per_s": 10000}]},
    "decode": {
        "itl_s": 0.05,
        "points": [{"context_tokens": 100, "tokens_per_s": 1000}, {"context_tokens": 10000, "tokens_per_s": 1000}],
    },
}


def flat_profile() -> Profile:
    return Profile.from_dict(FLAT_PROFILE)


def targets(
    *,
    ttft_s: float | None = 0.5,
    itl_s: float | None = 0.05,
    min_replicas: int = 1,
    max_replicas: int = 8,
    stability: Stability | None = None,
    gpu_budget: int | None = None,
    enabled: bool = True,
    advisory: bool = False,
    predictor: PredictorName = "constant",
    load: LoadThresholds | None = None,
) -> Targets:
    """TTFT 0.5 s and ITL 50 ms at p90, 1 to 8 replicas, no budget, the constant predictor, and no
    cooldown unless asked (tests of other behaviours should not wait for it)."""
    return Targets(
        default=GroupTargets(ttft_s=ttft_s, itl_s=itl_s, min_replicas=min_replicas, max_replicas=max_replicas),
        gpu_budget=gpu_budget,
        enabled=enabled,
        advisory=advisory,
        predictor=predictor,
        load=load or LoadThresholds(),
        stability=stability or Stability(cooldown_s=0, reversal_s=0, down_window_s=0),
    )


def replica(instance_id: int, *, queued: float | None = 0.0, kv: float | None = 0.0, active: int = 0) -> ReplicaLoad:
    return ReplicaLoad(instance_id=instance_id, active_requests=active, queued_prefill_tokens=queued, kv_usage=kv)


def group(
    role: Role,
    replicas: int,
    *,
    gpus: int = 1,
    queued: float | None = 0.0,
    kv: float | None = 0.0,
    active: int = 0,
    first_id: int = 1,
) -> GroupObservation:
    """A group of ``replicas`` replicas all reporting the same load."""
    loads = tuple(replica(first_id + i, queued=queued, kv=kv, active=active) for i in range(replicas))
    return GroupObservation(role=role, replicas=replicas, gpus_per_replica=gpus, loads=loads)


def observation(
    *groups: GroupObservation,
    rate: float = 0.0,
    isl: float | None = 1000.0,
    osl: float | None = 100.0,
    ttft: float | None = None,
    itl: float | None = None,
    hit: float | None = None,
    interval: float = 10.0,
) -> Observation:
    return Observation(
        interval_s=interval,
        request_rate=rate,
        mean_isl=isl,
        mean_osl=osl,
        ttft_s=ttft,
        itl_s=itl,
        prefix_hit_rate=hit,
        groups=groups,
    )
