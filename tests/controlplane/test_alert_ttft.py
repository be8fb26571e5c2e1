"""The TTFT figure the alert rule reads: the p95 of the gateway's TTFT histogram for the pipeline's served
name, over the requests since the previous reading, from a real HTTP server answering the gateway's own
exposition; and the beat task that runs the rules."""

import pytest
from django.core.cache import cache

from controlplane.alerts.models import Alert
from controlplane.alerts.tasks import evaluate_alerts
from controlplane.alerts.ttft import p95_ms, recent_ttft_p95
from controlplane.celery_app import EVALUATE_ALERTS_TASK, create_app
from controlplane.fleet.models import Node
from frontend_gateway.metrics import GatewayMetrics
from tests.controlplane.factories import deploy, make_node
from tests.controlplane.test_dashboard_gateway import gateway as gateway  # a fixture, used by name

pytestmark = pytest.mark.django_db


def observe(metrics: GatewayMetrics, model: str, ttft_s: float, times: int) -> None:
    for _ in range(times):
        metrics.for_model(model).ttft.observe(ttft_s)


def test_the_p95_is_over_the_requests_since_the_previous_reading(gateway: GatewayMetrics) -> None:
    pipeline = deploy("chat", ttft_target_ms=500)
    observe(gateway, "chat", 5.0, 50)  # slow, but before the first reading
    assert recent_ttft_p95(pipeline) is None  # nothing to compare with yet
    observe(gateway, "chat", 0.04, 100)
    observe(gateway, "other", 9.0, 100)  # another model's requests do not count
    fast = recent_ttft_p95(pipeline)
    assert fast is not None and fast <= 50
    observe(gateway, "chat", 2.0, 100)
    slow = recent_ttft_p95(pipeline)
    assert slow is not None and slow >= 2000
    assert recent_ttft_p95(pipeline) is None  # no request since


def test_without_a_gateway_url_or_with_a_dead_gateway_there_is_no_figure(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pipeline = deploy("chat", ttft_target_ms=500)
    monkeypatch.delenv("FLOTILLA_GATEWAY_URL", raising=False)
    assert recent_ttft_p95(pipeline) is None
    monkeypatch.setenv("FLOTILLA_GATEWAY_URL", "http://127.0.0.1:9")
    cache.clear()
    assert recent_ttft_p95(pipeline) is None
    assert "TTFT not read for the alert of chat" in caplog.text


def test_a_gateway_restart_between_readings_gives_no_figure() -> None:
    assert p95_ms({0.1: 1.0, float("inf"): 1.0}, {0.1: 10.0, float("inf"): 10.0}) is None


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
