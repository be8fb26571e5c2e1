"""Timestamps that are compared come from one clock, the database's: heartbeats are stamped by it and the
reconciler measures silence on it (controlplane/database.py: db_now), so processes whose clocks disagree
still agree on how long a node has been silent."""

from collections.abc import Callable
from datetime import datetime, timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from controlplane.audit.records import Actor
from controlplane.database import db_now
from controlplane.deployments import instances as instance_actions
from controlplane.deployments.models import Instance
from controlplane.deployments.reconciler import PassReport, Reconciler, ReconcilerSettings
from controlplane.deployments.upkeep import place_pending_instances
from controlplane.fleet import actions as fleet_actions
from controlplane.fleet.models import Node
from runtime.fleet_contract.reports import InstanceReport
from tests.controlplane.factories import TEST_ACTOR, deploy, make_node, node_report
from tests.controlplane.reconciling import RecordingDispatcher

pytestmark = [pytest.mark.django_db, pytest.mark.postgresql]

AN_HOUR = timedelta(hours=1)


@pytest.fixture
def clock_behind(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """This process's clock runs an hour behind the database's (as a second API server's might); call the
    result to set it right again."""
    real_now = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: real_now() - AN_HOUR)
    return monkeypatch.undo


def stamped_between(node_name: str, before: datetime, after: datetime) -> bool:
    stamp = Node.objects.get(name=node_name).last_heartbeat_at
    assert stamp is not None
    return before <= stamp <= after


def test_the_databases_now_is_read_from_the_database(clock_behind: Callable[[], None]) -> None:
    with CaptureQueriesContext(connection) as queries:
        now = db_now()
    assert len(queries) == 1
    assert abs(now - (timezone.now() + AN_HOUR)) < timedelta(seconds=5)  # not the process's clock


def test_a_registration_is_stamped_with_the_databases_time(clock_behind: Callable[[], None]) -> None:
    before = db_now()
    node = make_node("gpu-a")
    after = db_now()

    assert stamped_between("gpu-a", before, after)
    assert node.last_heartbeat_at == Node.objects.get().last_heartbeat_at  # the reply shows the stamp


def test_a_heartbeat_is_stamped_with_the_databases_time(clock_behind: Callable[[], None]) -> None:
    make_node("gpu-a", (80,))
    before = db_now()
    fleet_actions.heartbeat(TEST_ACTOR, "gpu-a", node_report((80,), used_gib=1))  # usage only
    after = db_now()
    assert stamped_between("gpu-a", before, after)

    Node.objects.update(state=Node.State.OFFLINE)
    before = db_now()
    fleet_actions.heartbeat(TEST_ACTOR, "gpu-a", node_report((80,)))  # back online
    after = db_now()
    assert stamped_between("gpu-a", before, after)


def test_an_instances_state_changes_and_progress_are_stamped_with_the_databases_time(
    clock_behind: Callable[[], None],
) -> None:
    make_node("gpu-a", (80,))
    deploy("chat", gpus_per_replica=1)
    place_pending_instances(TEST_ACTOR)
    instance = Instance.objects.get()
    agent = Actor.agent("gpu-a")

    before = db_now()
    instance_actions.report_instance_state(agent, "gpu-a", instance.pk, InstanceReport(state="downloading"))
    after = db_now()
    instance.refresh_from_db()
    # The start deadline and the restart backoff are measured from state_changed_at, a stalled download
    # from updated_at: a process whose clock is behind would make them come an hour late.
    assert before <= instance.state_changed_at <= after and before <= instance.updated_at <= after

    before = db_now()
    progress = InstanceReport(state="downloading", download_progress=0.5)
    instance_actions.report_instance_state(agent, "gpu-a", instance.pk, progress)  # same state: details only
    after = db_now()
    instance.refresh_from_db()
    assert before <= instance.updated_at <= after


def test_the_reconcilers_clock_is_the_databases_by_default(clock_behind: Callable[[], None]) -> None:
    reconciler = Reconciler(RecordingDispatcher(), ReconcilerSettings())
    before = db_now()
    with CaptureQueriesContext(connection) as queries:
        now = reconciler.clock()
    after = db_now()

    assert len(queries) == 1
    assert before <= now <= after


def test_a_heartbeat_taken_by_a_process_whose_clock_is_behind_is_not_taken_for_silence(
    clock_behind: Callable[[], None],
) -> None:
    make_node("gpu-a")
    fleet_actions.heartbeat(TEST_ACTOR, "gpu-a", node_report((80, 80)))
    clock_behind()  # the reconciler runs elsewhere, on a clock that is right

    report = PassReport()
    Reconciler(RecordingDispatcher(), ReconcilerSettings(node_timeout_s=15)).fail_lost_nodes(report)

    assert report.nodes_offline == []
    assert Node.objects.get().state == Node.State.ONLINE
