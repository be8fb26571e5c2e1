"""SLA mode: size each group from the predicted demand and the profile's capacity at the targets.

For a predicted request rate ``r``, prompt length ``isl`` (of which a share ``h`` is found cached) and
completion length ``osl``:

* a prefill replica computes ``prefill(isl)`` prompt tokens per second within the TTFT target, so the
  group needs ``r · isl · (1 − h) / prefill(isl)`` replicas;
* a decode replica produces ``decode(isl + osl/2)`` tokens per second within the ITL target (the mean
  context over a completion), so the group needs ``r · osl / decode(isl + osl/2)``;
* an aggregated replica does both in turn: the sum of the two.

Replicas are the need rounded up (up as soon as the need is over the current count, or with a noise tolerance
once it is over by more than the predicted rate's noise); down only when the need fits in fewer replicas with
the stability margin to spare. When the measured latency is over the target
although the profile says the group is large enough, the profile is optimistic for this traffic: its
capacity is discounted by target/measured (at most by half) until the latency is back.
"""

import math
from dataclasses import dataclass

from planner.observation import GroupObservation, Observation
from planner.profile import CapacityCurve, Profile
from planner.settings import GroupTargets, Role
from planner.sizing import Sizing, amount, percent, replicas, seconds

#: The most the measured latency may discount the profile's capacity: by half.
MAX_DISCOUNT = 0.5
#: A need this close under a whole number is that number (floating point).
EPSILON = 1e-9


@dataclass(frozen=True)
class Demand:
    """The next interval's predicted traffic."""

    request_rate: float
    isl: float
    osl: float
    prefix_hit_rate: float = 0.0


def missing_target(role: Role, targets: GroupTargets) -> str | None:
    """The target SLA sizing of ``role`` lacks (None: it has what it needs)."""
    if role in ("prefill", "aggregated") and targets.ttft_s is None:
        return "TTFT"
    if role in ("decode", "aggregated") and targets.itl_s is None:
        return "ITL"
    return None


def sla_sizing(
    group: GroupObservation,
    demand: Demand,
    profile: Profile,
    targets: GroupTargets,
    observation: Observation,
    margin: float,
    *,
    rate_noise: float = 0.0,
) -> Sizing:
    """The replicas ``group`` needs for ``demand`` at ``targets``, by ``profile``. It grows only when the need is
    over its replicas with the request rate ``rate_noise`` requests/s lower (the noise tolerance)."""
    role, current = group.role, group.replicas
    prefill_tokens = demand.request_rate * demand.isl * (1 - demand.prefix_hit_rate)
    decode_tokens = demand.request_rate * demand.osl
    context = demand.isl + demand.osl / 2
    prefill_cap = profile.prefill.at(demand.isl)
    decode_cap = profile.decode.at(context)
    # Replicas busy all the time (need), and replica-seconds per request (cost), of this role's phases.
    need, cost = 0.0, 0.0
    if role in ("prefill", "aggregated"):
        need += prefill_tokens / prefill_cap
        cost += demand.isl * (1 - demand.prefix_hit_rate) / prefill_cap
    if role in ("decode", "aggregated"):
        need += decode_tokens / decode_cap
        cost += demand.osl / decode_cap

    notes = _profile_notes(role, demand, context, profile, targets) if demand.request_rate > 0 else []
    over = _over_target(role, targets, observation)
    discount = 1.0
    said = latency_note(role, targets, observation)
    if over is not None and said is not None:
        _, measured, target = over
        if current >= math.ceil(need - EPSILON) and need > 0:
            discount = max(MAX_DISCOUNT, target / measured)
            notes.insert(0, f"{said} with enough replicas by the profile: its capacity taken at {percent(discount)}")
        else:
            notes.insert(0, said)
    need /= discount
    cost /= discount

    per_replica = f"{amount(1 / cost)} req/s each" if cost > 0 else "no work per request"
    up = math.ceil(need - EPSILON)
    # The need with the rate at the low end of its noise: what growing must be sure of (unless the latency is
    # over its target already: then the discounted capacity says more than the rate's noise).
    low = need * max(0.0, demand.request_rate - rate_noise) / demand.request_rate if demand.request_rate > 0 else need
    if up > current and discount == 1.0 and math.ceil(low - EPSILON) <= current:
        wanted = current
        verdict = (
            f"needs {replicas(need, role)} at {per_replica}: within the rate's noise "
            f"(±{amount(rate_noise)} req/s) of {replicas(current)}"
        )
    elif up > current:
        wanted = up
        verdict = f"needs {replicas(up, role)} at {per_replica}"
    else:
        wanted = min(current, math.ceil(need / (1 - margin) - EPSILON))
        if wanted < current:
            verdict = f"needs {replicas(need, role)} at {per_replica}: fits in {replicas(wanted)} with the margin"
        elif need < current - EPSILON and current > 0:
            verdict = f"needs {replicas(need, role)} at {per_replica}: not enough to spare for one fewer"
        else:
            verdict = f"needs {replicas(up, role)} at {per_replica}"
    if demand.request_rate > 0:
        traffic = (
            f"predicted {amount(demand.request_rate)} req/s "
            f"(ISL {amount(demand.isl)}, OSL {amount(demand.osl)} tokens) {verdict}"
        )
    else:
        traffic = "no requests predicted" + (f": {replicas(wanted)} enough" if wanted < current else "")
    return Sizing(wanted, "; ".join([*notes, traffic]))


def latency_note(role: Role, targets: GroupTargets, observation: Observation) -> str | None:
    """``TTFT p90 0.82 s over target 0.50 s`` when the latency of ``role``'s phase is (None: it is not, or
    it was measured at another percentile than the target's)."""
    over = _over_target(role, targets, observation)
    if over is None:
        return None
    name, measured, target = over
    return f"{name} p{observation.percentile:g} {seconds(measured)} over target {seconds(target)}"


def _over_target(role: Role, targets: GroupTargets, observation: Observation) -> tuple[str, float, float] | None:
    """The measured latency of ``role``'s phase that is over its target, if one is (the worse one for an
    aggregated group, as a share of its target). A latency measured at another percentile says nothing of
    the target's."""
    if observation.percentile != targets.percentile:
        return None
    found: list[tuple[str, float, float]] = []
    if role in ("prefill", "aggregated") and targets.ttft_s and observation.ttft_s:
        found.append(("TTFT", observation.ttft_s, targets.ttft_s))
    if role in ("decode", "aggregated") and targets.itl_s and observation.itl_s:
        found.append(("ITL", observation.itl_s, targets.itl_s))
    over = [item for item in found if item[1] > item[2]]
    return max(over, key=lambda item: item[1] / item[2]) if over else None


def _profile_notes(role: Role, demand: Demand, context: float, profile: Profile, targets: GroupTargets) -> list[str]:
    """What the reader should know about how well the profile fits: a stricter target than it was measured
    at, or lengths outside its points."""
    notes = []
    checks: list[tuple[str, CapacityCurve, float | None, str, float]] = []
    if role in ("prefill", "aggregated"):
        checks.append(("TTFT", profile.prefill, targets.ttft_s, "ISL", demand.isl))
    if role in ("decode", "aggregated"):
        checks.append(("ITL", profile.decode, targets.itl_s, "context", context))
    for name, curve, target, length_name, length in checks:
        if target is not None and target < curve.target_s:
            notes.append(
                f"{name} target {seconds(target)} is stricter than the profile's {seconds(curve.target_s)}: "
                "its capacity may be too high"
            )
        if not curve.covers(length):
            edge = curve.lengths[0] if length < curve.lengths[0] else curve.lengths[-1]
            notes.append(f"{length_name} {amount(length)} outside the profile: capacity at {amount(edge)} used")
    return notes
