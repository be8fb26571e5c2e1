"""The planner: from one interval's observation, targets and an optional profile, each group's decision.

``Planner`` holds only what the decisions need to remember: the predictors' history and, per group, when
it last changed and in which direction. Time is passed in (``now``, seconds on any monotonic clock), so
the same inputs give the same decisions, and tests run in simulated time.
"""

import math
from collections import deque
from dataclasses import dataclass

from planner.bounds import Ask, drain_order, fit_budget, in_flight_floor
from planner.decision import Bound, Decision, Mode
from planner.load_mode import load_sizing
from planner.observation import GroupObservation, Observation
from planner.predict import Predictor, make_predictor
from planner.profile import Profile
from planner.settings import PredictorName, Role, Targets
from planner.sizing import Sizing, replicas, seconds
from planner.sla_mode import Demand, latency_note, missing_target, sla_sizing


@dataclass(frozen=True)
class _Change:
    at: float
    direction: int  # +1 up, -1 down


@dataclass
class _Draft:
    """One group's decision while the bounds are applied."""

    group: GroupObservation
    mode: Mode
    sizing: Sizing
    desired: int
    bound: Bound | None = None
    note: str = ""
    min_replicas: int = 0

    def hold(self, value: int, bound: Bound, note: str) -> None:
        self.desired, self.bound, self.note = value, bound, note


class Planner:
    """One pipeline's planner. Call ``decide`` once per interval with what was observed over it."""

    def __init__(self, predictor: PredictorName = "trend") -> None:
        self._predictor_name = predictor
        self._rate, self._isl, self._osl = self._predictors()
        self._changes: dict[Role, _Change] = {}
        # What each group's load asked for lately: (when, replicas), for the scale-down window.
        self._wanted: dict[Role, deque[tuple[float, int]]] = {}

    def _predictors(self) -> tuple[Predictor, Predictor, Predictor]:
        name = self._predictor_name
        return make_predictor(name), make_predictor(name), make_predictor(name)

    def demand(self) -> Demand | None:
        """The next interval's traffic as predicted now (None: no interval with requests seen yet)."""
        rate, isl, osl = self._rate.predict(), self._isl.predict(), self._osl.predict()
        if rate is None:
            return None
        return Demand(rate, isl or 0.0, osl or 0.0)

    def decide(
        self, now: float, targets: Targets, observation: Observation, profile: Profile | None = None
    ) -> list[Decision]:
        """Each observed group's decision, in the observation's order. The planner remembers a change as
        made (its cooldown starts) whenever a decision changes a group, advisory or not, so that advisory
        mode shows what acting would have done."""
        if targets.predictor != self._predictor_name:
            self._predictor_name = targets.predictor
            self._rate, self._isl, self._osl = self._predictors()
        self._learn(observation)
        if not targets.enabled:
            return [
                Decision(g.role, g.replicas, g.replicas, g.replicas, "off", "planner off for this pipeline")
                for g in observation.groups
            ]
        drafts = [
            self._bound(now, targets, self._size(targets, observation, profile, group)) for group in observation.groups
        ]
        self._fit_budget(targets, drafts)
        decisions = [self._decision(targets, draft) for draft in drafts]
        for decision in decisions:
            if decision.change:
                self._changes[decision.role] = _Change(now, 1 if decision.change > 0 else -1)
        return decisions

    def _learn(self, observation: Observation) -> None:
        self._rate.observe(observation.request_rate)
        if observation.mean_isl is not None:
            self._isl.observe(observation.mean_isl)
        if observation.mean_osl is not None:
            self._osl.observe(observation.mean_osl)

    def _size(
        self, targets: Targets, observation: Observation, profile: Profile | None, group: GroupObservation
    ) -> _Draft:
        """What ``group``'s load asks for, by its profile (SLA mode) or its thresholds (load mode)."""
        group_targets = targets.for_group(group.role)
        stability = targets.stability
        demand = self.demand()
        fallback = ""
        if profile is None:
            fallback = "no profile: load mode"
        elif (missing := missing_target(group.role, group_targets)) is not None:
            fallback = f"no {missing} target for the {group.role} group: load mode"
        elif demand is None or (demand.request_rate > 0 and (demand.isl <= 0 or demand.osl <= 0)):
            fallback = "no request lengths seen yet: load mode"
        if fallback or profile is None or demand is None:
            sizing = load_sizing(group, targets.load, stability.scale_down_margin)
            latency = latency_note(group.role, group_targets, observation)
            said = "; ".join(part for part in (fallback, latency, sizing.reason) if part)
            sizing = Sizing(sizing.wanted, said)
            mode: Mode = "load"
        else:
            hit = observation.prefix_hit_rate or 0.0
            demand = Demand(demand.request_rate, demand.isl, demand.osl, min(max(hit, 0.0), 1.0))
            noise = stability.noise_tolerance * self._rate_error(demand.request_rate, observation.interval_s)
            sizing = sla_sizing(
                group, demand, profile, group_targets, observation, stability.scale_down_margin, rate_noise=noise
            )
            mode = "sla"
        return _Draft(group, mode, sizing, sizing.wanted, min_replicas=group_targets.min_replicas)

    def _rate_error(self, rate: float, interval_s: float) -> float:
        """The standard error of a predicted request ``rate`` (requests/s) from arrivals counted over intervals of
        ``interval_s``: Poisson counts, through the predictor's smoothing."""
        if rate <= 0 or interval_s <= 0:
            return 0.0
        return math.sqrt(self._rate.noise_factor * rate / interval_s)

    def _bound(self, now: float, targets: Targets, draft: _Draft) -> _Draft:
        """``draft`` held within its group's bounds (all but the budget, which spans the groups), in the order
        docs/planner.md gives; the last bound that moved it is the one named."""
        group, mode, sizing = draft.group, draft.mode, draft.sizing
        group_targets = targets.for_group(group.role)
        stability = targets.stability
        current = group.replicas
        recent = self._wanted.setdefault(group.role, deque())
        recent.append((now, sizing.wanted))
        while recent and recent[0][0] < now - stability.down_window_s:
            recent.popleft()
        if draft.desired < current:
            highest = max(wanted for _, wanted in recent)
            if highest > draft.desired:
                draft.hold(
                    min(highest, current),
                    "down_window",
                    f"{replicas(highest)} asked for within {seconds(stability.down_window_s)}",
                )
        if draft.desired < current:
            floor, why = in_flight_floor(group, targets.load)
            if floor > draft.desired:
                draft.hold(min(floor, current), "in_flight", why)
        if draft.desired < current - stability.max_step_down:
            draft.hold(current - stability.max_step_down, "step", f"at most {stability.max_step_down} fewer at once")
        if draft.desired > current and mode == "load" and group.reporting < current:
            starting = current - group.reporting
            draft.hold(current, "starting", f"waiting for {replicas(starting)} starting to take load")
        if draft.desired != current and (last := self._changes.get(group.role)) is not None:
            since = now - last.at
            direction = 1 if draft.desired > current else -1
            if since < stability.cooldown_s:
                draft.hold(
                    current, "cooldown", f"changed {seconds(since)} ago (cooldown {seconds(stability.cooldown_s)})"
                )
            elif direction != last.direction and since < stability.reversal_s:
                draft.hold(
                    current,
                    "reversal",
                    f"scaled {'down' if last.direction < 0 else 'up'} {seconds(since)} ago "
                    f"(no reversal within {seconds(stability.reversal_s)})",
                )
        if draft.desired < group_targets.min_replicas:
            draft.hold(group_targets.min_replicas, "min_replicas", f"min replicas {group_targets.min_replicas}")
        elif draft.desired > group_targets.max_replicas:
            draft.hold(group_targets.max_replicas, "max_replicas", f"max replicas {group_targets.max_replicas}")
        return draft

    def _fit_budget(self, targets: Targets, drafts: list[_Draft]) -> None:
        asks = [
            Ask(d.group.role, d.group.replicas, d.desired, d.group.gpus_per_replica, d.min_replicas) for d in drafts
        ]
        granted = fit_budget(asks, targets.gpu_budget)
        for draft in drafts:
            fitted = granted[draft.group.role]
            if fitted != draft.desired:
                used = sum(granted[d.group.role] * d.group.gpus_per_replica for d in drafts)
                if targets.gpu_budget is not None and used > targets.gpu_budget:
                    note = f"min replicas: they need {used} GPUs, over the GPU budget {targets.gpu_budget}"
                else:
                    note = f"GPU budget {targets.gpu_budget}: {used} GPUs with {fitted} here"
                draft.hold(fitted, "gpu_budget", note)

    def _decision(self, targets: Targets, draft: _Draft) -> Decision:
        group = draft.group
        current, desired = group.replicas, draft.desired
        reason = draft.sizing.reason
        if draft.bound is not None and desired != draft.sizing.wanted:
            reason += f"; held at {desired} by {draft.note}"
        drain = max(0, current - desired)
        drained = drain_order(group, drain)
        if drain:
            in_flight = sum(load.active_requests for load in group.loads if load.instance_id in drained)
            names = ", ".join(str(i) for i in drained) or "not yet reporting"
            requests = f"{in_flight} request{'' if in_flight == 1 else 's'}"
            reason += f"; drain {replicas(drain)} (instance {names}: {requests} in flight to finish first)"
        if targets.advisory:
            reason += "; advisory: not acted on"
        return Decision(
            role=group.role,
            current=current,
            desired=desired,
            wanted=draft.sizing.wanted,
            mode=draft.mode,
            reason=reason,
            bound=draft.bound if desired != draft.sizing.wanted else None,
            advisory=targets.advisory,
            drain=drain,
            drain_instances=drained,
        )
