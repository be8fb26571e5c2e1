"""Each alert rule on rows made as the control plane makes them: what fires, about which subject, and what
does not fire."""

import datetime

import pytest
from django.utils import timezone

from controlplane.accounts.models import Role
from controlplane.alerts import rules
from controlplane.alerts.config import AlertSettings
from controlplane.alerts.models import Rule, Severity
from controlplane.apikeys import actions as key_actions
from controlplane.apikeys.models import KeyUsage
from controlplane.audit.records import Actor
from controlplane.deployments import instances as instance_actions
from controlplane.deployments import upkeep
from controlplane.deployments.instance_states import InstanceState
from controlplane.deployments.models import Instance
from controlplane.fleet.models import Node
from tests.controlplane.factories import deploy, make_node, make_user, placed_instance, run_instance

pytestmark = pytest.mark.django_db

SETTINGS = AlertSettings(crash_restarts=3, crash_window_s=600, pending_s=120)
RECONCILER = Actor.system("reconciler")


def crash(instance: Instance) -> Instance:
    """The instance fails on its node and the reconciler restarts it (then places it again)."""
    run_instance(instance, InstanceState.FAILED)
    instance.refresh_from_db()
    upkeep.restart_failed_instance(RECONCILER, instance)
    upkeep.place_pending_instances(RECONCILER)
    instance.refresh_from_db()
    return instance


def test_an_instance_restarted_three_times_in_the_window_is_a_crash_loop() -> None:
    instance = placed_instance()
    for _ in range(2):
        instance = crash(instance)
    assert rules.crash_loops(SETTINGS, timezone.now()) == []
    instance = crash(instance)
    [firing] = rules.crash_loops(SETTINGS, timezone.now())
    assert (firing.rule, firing.subject_type, firing.subject_id) == (Rule.CRASH_LOOP, "instance", str(instance.pk))
    assert firing.subject_name == instance.name and "restarted 3 times in the last 10 minutes" in firing.message
    # Restarts older than the window do not count.
    later = timezone.now() + datetime.timedelta(seconds=601)
    assert rules.crash_loops(SETTINGS, later) == []


def test_a_replica_that_crash_loops_on_across_a_new_row_counts_the_restarts_of_the_rows_it_replaced() -> None:
    instance = placed_instance()
    for _ in range(2):
        instance = crash(instance)
    # Drained to a new row (its node's GPU given up by a person, say): the replica runs on as that row.
    [successor] = instance_actions.add_instances(RECONCILER, instance.group, 1, reason="drain", replaces=instance)
    upkeep.place_pending_instances(RECONCILER)  # waits: the only GPU is the old row's
    Instance.objects.filter(pk=instance.pk).update(state=InstanceState.STOPPED, node=None, gpu_indexes=[])
    upkeep.place_pending_instances(RECONCILER)
    successor.refresh_from_db()
    assert rules.crash_loops(SETTINGS, timezone.now()) == []  # two restarts: not yet
    successor = crash(successor)
    [firing] = rules.crash_loops(SETTINGS, timezone.now())
    assert (firing.subject_id, firing.subject_name) == (str(successor.pk), successor.name)
    assert "restarted 3 times in the last 10 minutes (with the rows it replaced)" in firing.message
    # The old rows' restarts age out of the window like the row's own.
    assert rules.crash_loops(SETTINGS, timezone.now() + datetime.timedelta(seconds=601)) == []


def test_an_instance_the_reconciler_gave_up_on_is_a_critical_crash_loop() -> None:
    instance = placed_instance()
    run_instance(instance, InstanceState.FAILED)
    Instance.objects.filter(pk=instance.pk).update(gave_up=True, failure_streak=5, reason="exit code 1: CUDA OOM")
    [firing] = rules.crash_loops(SETTINGS, timezone.now())
    assert firing.severity == Severity.CRITICAL and "CUDA OOM" in firing.message and "not restarted" in firing.message


def test_an_instance_unplaced_for_longer_than_the_limit_is_unschedulable() -> None:
    make_node("gpu-a", (80,))
    deploy("big", gpus_per_replica=2)
    upkeep.place_pending_instances(RECONCILER)
    instance = Instance.objects.get()
    assert instance.reason  # placement said why
    assert rules.unschedulable(SETTINGS, timezone.now()) == []  # not for long yet
    [firing] = rules.unschedulable(SETTINGS, timezone.now() + datetime.timedelta(seconds=121))
    assert firing.subject_name == instance.name and instance.reason in firing.message


def test_a_pending_instance_without_a_placement_reason_is_not_unschedulable() -> None:
    deploy("waiting")  # no node at all has been asked yet: no reason on the row
    assert rules.unschedulable(SETTINGS, timezone.now() + datetime.timedelta(hours=1)) == []


def test_a_node_offline_or_silent_past_the_node_timeout_fires(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_NODE_TIMEOUT_S", "15")
    make_node("gpu-a")
    make_node("gpu-b")
    make_node("gpu-c")
    now = timezone.now()
    Node.objects.filter(name="gpu-a").update(state=Node.State.OFFLINE)
    Node.objects.filter(name="gpu-b").update(last_heartbeat_at=now - datetime.timedelta(seconds=16))
    Node.objects.filter(name="gpu-c").update(last_heartbeat_at=now - datetime.timedelta(seconds=5))
    firing = rules.nodes_offline(SETTINGS, now)
    assert sorted(item.subject_name for item in firing) == ["gpu-a", "gpu-b"]
    assert all(item.severity == Severity.CRITICAL and "limit 15 s" in item.message for item in firing)


def test_a_key_at_its_monthly_budget_fires_and_one_under_it_does_not() -> None:
    owner = make_user("olga", Role.OPERATOR)
    actor = Actor.person(owner)
    spent, _ = key_actions.create_key(actor, owner, "spent", monthly_token_budget=100)
    fine, _ = key_actions.create_key(actor, owner, "fine", monthly_token_budget=1000)
    key_actions.create_key(actor, owner, "unlimited")
    today = timezone.now().date()
    KeyUsage.objects.create(key=spent, model="chat", day=today, prompt_tokens=60, completion_tokens=40)
    KeyUsage.objects.create(key=fine, model="chat", day=today, prompt_tokens=60, completion_tokens=40)
    # Last month's tokens do not count.
    KeyUsage.objects.create(
        key=fine, model="chat", day=today.replace(day=1) - datetime.timedelta(days=1), prompt_tokens=5000
    )
    [firing] = rules.key_budgets(SETTINGS, timezone.now())
    assert firing.subject_name == "spent (olga)" and "used 100 of its monthly budget of 100" in firing.message


def test_a_pipeline_over_its_ttft_target_fires_and_one_without_a_figure_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fast = deploy("fast", ttft_target_ms=500)
    slow = deploy("slow", ttft_target_ms=500)
    deploy("untargeted")
    quiet = deploy("quiet", ttft_target_ms=500)
    figures = {fast.pk: 420.0, slow.pk: 900.0, quiet.pk: None}
    monkeypatch.setattr(rules, "recent_ttft_p95", lambda pipeline: figures.get(pipeline.pk, 5000.0))
    [firing] = rules.ttft_over_target(SETTINGS, timezone.now())
    assert firing.subject_name == "slow" and "is 900 ms, over its target of 500 ms" in firing.message
