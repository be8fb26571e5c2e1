"""The TTFT figure the alert rule reads: the pipeline's p95 over the last minute of its metric samples (the
bridge's, controlplane/traffic); and the beat task that runs the rules."""

import datetime

import pytest

from controlplane.alerts.models import Alert
from controlplane.alerts.tasks import evaluate_alerts
from controlplane.alerts.ttft import recent_ttft_p95
from controlplane.celery_app import EVALUATE_ALERTS_TASK, create_app
from controlplane.deployments.models import Pipeline
from controlplane.fleet.models import Node
from controlplane.traffic.models import MetricSample
from tests.controlplane.factories import deploy, make_node

pytestmark = pytest.mark.django_db


NOW = datetime.datetime(2026, 11, 28, 12, 0, tzinfo=datetime.UTC)


def sample(pipeline: Pipeline, seconds_ago: float, requests: int, ttft_p95_s: float | None) -> None:
    MetricSample.objects.create(
        at=NOW - datetime.timedelta(seconds=seconds_ago), window_s=10, scope=MetricSample.Scope.PIPELINE,
        pipeline=pipeline, requests=requests, ttft_p95_s=ttft_p95_s,
    )  # fmt: skip


def test_the_p95_is_the_request_weighted_p95_of_the_pipeline_s_samples_of_the_last_minute() -> None:
    pipeline, other = deploy("chat", ttft_target_ms=500), deploy("other")
    sample(pipeline, 5, requests=30, ttft_p95_s=0.1)
    sample(pipeline, 15, requests=10, ttft_p95_s=0.9)
    sample(pipeline, 25, requests=0, ttft_p95_s=None)  # a quiet window: no figure, no weight
    sample(pipeline, 120, requests=100, ttft_p95_s=9.0)  # older than the window
    sample(other, 5, requests=100, ttft_p95_s=5.0)  # another pipeline's
    p95 = recent_ttft_p95(pipeline, NOW)
    assert p95 is not None and abs(p95 - (30 * 100 + 10 * 900) / 40) < 1e-6


def test_no_request_in_the_window_gives_no_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    pipeline = deploy("chat", ttft_target_ms=500)
    assert recent_ttft_p95(pipeline, NOW) is None  # no samples: no bridge, or nothing yet
    sample(pipeline, 30, requests=0, ttft_p95_s=None)
    assert recent_ttft_p95(pipeline, NOW) is None
    sample(pipeline, 30, requests=5, ttft_p95_s=2.0)
    monkeypatch.setenv("FLOTILLA_ALERT_TTFT_WINDOW_S", "20")  # a shorter window leaves it out
    assert recent_ttft_p95(pipeline, NOW) is None


def test_the_beat_runs_the_rules_every_interval_and_its_task_records_alerts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_ALERT_EVERY_S", "15")
    app = create_app("memory://")
    [entry] = [entry for entry in app.conf.beat_schedule.values() if entry["task"] == EVALUATE_ALERTS_TASK]
    assert entry["schedule"] == 15.0
    make_node("gpu-a")
    Node.objects.update(state=Node.State.OFFLINE)
    result = evaluate_alerts()
    assert result is not None and result["fired"] == [f"node_offline:node:{Node.objects.get().pk}"]
    assert Alert.objects.get().subject_name == "gpu-a"
