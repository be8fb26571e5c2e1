"""The alert rules: each returns the alerts that fire now, read from the rows the control plane keeps.

A rule is a function ``(settings, now) -> list[Firing]``; ``evaluate.evaluate_rules`` turns what they return
into alert rows (new, still firing, resolved). A rule that cannot read what it needs raises; the pass logs
it and keeps that rule's alerts as they were (a rule's failure must not resolve its alerts).
"""

import datetime
from collections.abc import Callable
from dataclasses import dataclass

from django.db.models import Count, F, Q, Sum
from django.db.models.functions import Coalesce

from controlplane.alerts.config import AlertSettings
from controlplane.alerts.models import Rule, Severity
from controlplane.alerts.ttft import recent_ttft_p95
from controlplane.apikeys.models import ApiKey, KeyUsage
from controlplane.audit.models import AuditEntry
from controlplane.deployments.instance_states import InstanceState
from controlplane.deployments.models import Instance, Pipeline
from controlplane.deployments.reconciler import ReconcilerSettings
from controlplane.fleet.models import Node


@dataclass(frozen=True)
class Firing:
    """One alert that fires now."""

    rule: Rule
    subject_type: str
    subject_id: str
    subject_name: str
    message: str
    severity: Severity = Severity.WARNING

    @property
    def fingerprint(self) -> str:
        return f"{self.rule}:{self.subject_type}:{self.subject_id}"


RuleFunction = Callable[[AlertSettings, datetime.datetime], list[Firing]]


def crash_loops(settings: AlertSettings, now: datetime.datetime) -> list[Firing]:
    """Instances the reconciler gave up on, and those it restarted ``crash_restarts`` times or more within
    ``crash_window_s`` (its restarts after a failure, as the audit log has them)."""
    instances = Instance.objects.select_related("pipeline", "group").exclude(state=InstanceState.STOPPED)
    firing = [
        Firing(
            Rule.CRASH_LOOP,
            "instance",
            str(instance.pk),
            instance.name,
            f"{instance.name} failed {instance.failure_streak} time(s) in a row and is not restarted any more: "
            f"{instance.reason or 'no reason given'}",
            Severity.CRITICAL,
        )
        for instance in instances.filter(gave_up=True)
    ]
    since = now - datetime.timedelta(seconds=settings.crash_window_s)
    restarts = (
        AuditEntry.objects.filter(
            action="instance.restart", target_type="instance", created_at__gte=since, actor_name__startswith="system:"
        )
        .values("target_id")
        .annotate(count=Count("id"))
    )
    counts = {int(row["target_id"]): int(row["count"]) for row in restarts if row["target_id"].isdigit()}
    if not counts:
        return firing
    live = list(instances.filter(gave_up=False))
    chains = _replica_chains({instance.pk: instance.previous_id for instance in live})
    minutes = settings.crash_window_s / 60
    for instance in live:
        chain = chains[instance.pk]
        restarted = sum(counts.get(pk, 0) for pk in chain)
        if restarted < settings.crash_restarts:
            continue
        earlier = " (with the rows it replaced)" if restarted > counts.get(instance.pk, 0) else ""
        firing.append(
            Firing(
                Rule.CRASH_LOOP,
                "instance",
                str(instance.pk),
                instance.name,
                f"{instance.name} was restarted {restarted} times in the last {minutes:g} minutes{earlier}"
                + (f"; last failure: {instance.reason}" if instance.reason else ""),
            )
        )
    return firing


#: How far back a replica's rows are followed (``Instance.previous``) when its restarts are counted.
CHAIN_DEPTH = 10


def _replica_chains(previous_of: dict[int, int | None]) -> dict[int, list[int]]:
    """Each given instance's row and the rows it took the place of (``previous``, newest first, at most
    ``CHAIN_DEPTH``): a replica replaced on another node (a drain, an eviction) keeps its restarts."""
    known = dict(previous_of)
    chains = {pk: [pk] for pk in previous_of}
    for _ in range(CHAIN_DEPTH - 1):
        missing = {known[chain[-1]] for chain in chains.values() if known.get(chain[-1]) is not None} - known.keys()
        if missing:
            known |= dict(Instance.objects.filter(pk__in=missing).values_list("pk", "previous_id"))
        grew = False
        for chain in chains.values():
            before = known.get(chain[-1])
            if before is not None and before in known and before not in chain:
                chain.append(before)
                grew = True
        if not grew:
            break
    return chains


def unschedulable(settings: AlertSettings, now: datetime.datetime) -> list[Firing]:
    """Instances of running pipelines left unplaced for ``pending_s`` or longer because no node fits (the
    placement's reason is on the row)."""
    since = now - datetime.timedelta(seconds=settings.pending_s)
    waiting = Instance.objects.select_related("pipeline", "group").filter(
        pipeline__state=Pipeline.State.RUNNING,
        state=InstanceState.PENDING,
        node__isnull=True,
        state_changed_at__lte=since,
    )
    return [
        Firing(
            Rule.UNSCHEDULABLE,
            "instance",
            str(instance.pk),
            instance.name,
            f"{instance.name} cannot be placed: {instance.reason}",
        )
        for instance in waiting.exclude(reason="")
    ]


def nodes_offline(settings: AlertSettings, now: datetime.datetime) -> list[Firing]:
    """Nodes the reconciler marked offline, and those silent for longer than its ``FLOTILLA_NODE_TIMEOUT_S``
    (the reconciler may be the one that is down)."""
    timeout_s = ReconcilerSettings.from_env().node_timeout_s
    silent_since = now - datetime.timedelta(seconds=timeout_s)
    nodes = Node.objects.filter(Q(state=Node.State.OFFLINE) | Q(last_heartbeat_at__lt=silent_since))
    firing = []
    for node in nodes:
        last = "never" if node.last_heartbeat_at is None else f"at {node.last_heartbeat_at:%Y-%m-%d %H:%M:%S} UTC"
        firing.append(
            Firing(
                Rule.NODE_OFFLINE,
                "node",
                str(node.pk),
                node.name,
                f"node {node.name} is offline: its agent's last heartbeat came {last} (limit {timeout_s:g} s)",
                Severity.CRITICAL,
            )
        )
    return firing


def key_budgets(settings: AlertSettings, now: datetime.datetime) -> list[Firing]:
    """Live API keys whose tokens this UTC month (prompt and completion, as the ingress counts them) reached
    their monthly budget."""
    month_start = now.astimezone(datetime.UTC).date().replace(day=1)
    keys = ApiKey.objects.select_related("owner").filter(revoked_at__isnull=True, monthly_token_budget__isnull=False)
    used = dict(
        KeyUsage.objects.filter(key__in=keys, day__gte=month_start)
        .values("key")
        .annotate(tokens=Coalesce(Sum(F("prompt_tokens") + F("completion_tokens")), 0))
        .values_list("key", "tokens")
    )
    firing = []
    for key in keys:
        tokens = int(used.get(key.pk, 0))
        budget = key.monthly_token_budget
        if budget is not None and tokens >= budget:
            firing.append(
                Firing(
                    Rule.KEY_BUDGET,
                    "api_key",
                    str(key.pk),
                    f"{key.name} ({key.owner.get_username()})",
                    f"API key {key.name!r} of {key.owner.get_username()} used {tokens} of its monthly budget of "
                    f"{budget} tokens: the ingresses refuse it until the 1st (UTC) or until the budget is raised",
                )
            )
    return firing


def ttft_over_target(settings: AlertSettings, now: datetime.datetime) -> list[Firing]:
    """Running pipelines with a ``ttft_target_ms`` whose recent TTFT p95 is above it (no figure: no alert)."""
    firing = []
    for pipeline in Pipeline.objects.filter(state=Pipeline.State.RUNNING, ttft_target_ms__isnull=False):
        p95_ms = recent_ttft_p95(pipeline)
        target = pipeline.ttft_target_ms
        if p95_ms is None or target is None or p95_ms <= target:
            continue
        firing.append(
            Firing(
                Rule.TTFT_OVER_TARGET,
                "pipeline",
                str(pipeline.pk),
                pipeline.name,
                f"{pipeline.name}'s recent time to first token (p95) is {p95_ms:.0f} ms, over its target "
                f"of {target} ms",
            )
        )
    return firing


RULES: dict[Rule, RuleFunction] = {
    Rule.CRASH_LOOP: crash_loops,
    Rule.UNSCHEDULABLE: unschedulable,
    Rule.NODE_OFFLINE: nodes_offline,
    Rule.KEY_BUDGET: key_budgets,
    Rule.TTFT_OVER_TARGET: ttft_over_target,
}
