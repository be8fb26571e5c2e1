"""Actions that change desired state ask for a reconciler pass once they commit, and only then."""

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from controlplane import celery_app, reconcile_requests
from controlplane.audit.records import Actor
from controlplane.deployments import evacuation
from controlplane.deployments import instances as instance_actions
from controlplane.deployments import pipelines as pipeline_actions
from controlplane.deployments.models import Instance
from controlplane.errors import Invalid
from runtime.fleet_contract.reports import InstanceReport
from tests.controlplane.factories import TEST_ACTOR, deploy, make_node
from tests.controlplane.reconciling import Clock, RecordingDispatcher, make_reconciler

pytestmark = pytest.mark.django_db


@pytest.fixture
def requests(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The reconcile requests that would reach the broker."""
    sent: list[object] = []
    monkeypatch.setattr(celery_app, "send_reconcile_request", lambda app: sent.append(app) or True)
    return sent


@pytest.fixture
def committing(django_capture_on_commit_callbacks: Any) -> Callable[[], Any]:
    """``with committing():`` runs the on-commit callbacks of what happens inside, as a commit would, and
    waits for the requests they made to leave the sender's thread."""

    @contextlib.contextmanager
    def committed() -> Iterator[Any]:
        with django_capture_on_commit_callbacks(execute=True) as callbacks:
            yield callbacks
        assert reconcile_requests.settle(5.0)

    return committed


@pytest.fixture
def running() -> None:
    """A pipeline with one instance, placed and started on node gpu-a."""
    make_node("gpu-a", (80, 80))
    deploy("chat", gpus_per_replica=1)
    make_reconciler(RecordingDispatcher(), Clock()).run_once()


def test_a_scale_asks_for_one_pass_after_its_commit(
    running: None, requests: list[object], committing: Callable[[], Any]
) -> None:
    pipeline = Instance.objects.get().pipeline
    with committing():
        pipeline_actions.scale_pipeline(TEST_ACTOR, pipeline, 3)
        assert requests == []  # not before the commit: the pass must see the new rows
    assert requests == [celery_app.app]


@pytest.mark.parametrize(
    "change",
    [
        lambda i: pipeline_actions.stop_pipeline(TEST_ACTOR, i.pipeline),
        lambda i: pipeline_actions.update_pipeline(TEST_ACTOR, i.pipeline, placement_policy="binpack"),
        lambda i: evacuation.drain_node(TEST_ACTOR, i.node, force=True),
        lambda i: instance_actions.restart_instance(TEST_ACTOR, i),
        lambda i: instance_actions.report_instance_state(
            Actor.agent("gpu-a"), "gpu-a", i.pk, InstanceReport(state="failed", reason="exit code 1")
        ),
    ],
    ids=["stop", "update", "drain", "restart", "agent reports a failure"],
)
def test_changes_that_give_the_reconciler_work_ask_for_a_pass(
    running: None, requests: list[object], committing: Callable[[], Any], change: Callable[[Instance], Any]
) -> None:
    instance = Instance.objects.select_related("pipeline", "node").get()
    instance_actions.report_instance_state(Actor.agent("gpu-a"), "gpu-a", instance.pk, InstanceReport(state="ready"))
    with committing():
        change(instance)
    assert len(requests) == 1


def test_a_refused_action_asks_for_nothing(
    running: None, requests: list[object], committing: Callable[[], Any]
) -> None:
    pipeline = Instance.objects.get().pipeline
    with committing(), pytest.raises(Invalid):
        pipeline_actions.scale_pipeline(TEST_ACTOR, pipeline, -1)
    assert requests == []


def test_a_pass_asks_for_no_further_pass(requests: list[object], committing: Callable[[], Any]) -> None:
    make_node("gpu-a", (80, 80))
    deploy("chat", gpus_per_replica=1)
    with committing():
        make_reconciler(RecordingDispatcher(), Clock()).run_once()
    assert requests == []


def test_a_request_is_sent_from_a_thread_of_its_own_so_a_hung_broker_holds_no_caller() -> None:
    release = threading.Event()
    sent: list[str] = []

    def hung_broker() -> None:
        release.wait(10)  # a publish to a frozen Redis, until its socket timeout
        sent.append(threading.current_thread().name)

    sender = reconcile_requests.SendingThread(hung_broker)
    for _ in range(3):
        sender()  # returns at once though the broker answers nothing
    assert not sender.settle(0.05)  # still sending
    release.set()
    assert sender.settle(5.0)
    # The three calls became one or two sends (one that had started, one for what came meanwhile), none
    # on the caller's thread.
    assert 1 <= len(sent) <= 2 and threading.current_thread().name not in sent


def test_requests_within_the_interval_of_a_send_go_as_one_at_its_end() -> None:
    """Issue 39: one reconcile task per API call made passes run back to back under automation."""
    sent: list[float] = []
    sender = reconcile_requests.SendingThread(lambda: sent.append(time.monotonic()), min_interval_s=0.3)
    sender()
    assert sender.settle(5.0)  # the first after a quiet spell: at once
    for _ in range(5):
        sender()  # within the interval: held, then sent as one
    assert sender.settle(5.0)
    assert len(sent) == 2
    assert sent[1] - sent[0] >= 0.3
