"""``/metrics``: the fleet's states and the reconciler's passes from the database, request times per view."""

import math
import time
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from controlplane.deployments.instance_states import InstanceState
from controlplane.deployments.models import Instance
from controlplane.deployments.reconciler import LEASE_NAME
from controlplane.fleet.models import Node
from controlplane.health.models import ReconcilerPass
from controlplane.health.records import record_pass
from tests.controlplane.factories import deploy, make_node

pytestmark = pytest.mark.django_db


def scrape(client: Client | None = None) -> dict[str, list[Sample]]:
    response = (client or Client()).get("/metrics")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    return {family.name: family.samples for family in text_string_to_metric_families(response.content.decode())}


def by_label(samples: list[Sample], label: str) -> dict[str, float]:
    return {sample.labels[label]: sample.value for sample in samples}


def test_instances_and_nodes_are_counted_by_state_with_every_state_present() -> None:
    make_node("gpu-a")
    make_node("gpu-b")
    Node.objects.filter(name="gpu-b").update(state=Node.State.OFFLINE)
    deploy("chat", replicas=3)
    first, second, _ = Instance.objects.order_by("id")
    Instance.objects.filter(pk=first.pk).update(state=InstanceState.READY)
    Instance.objects.filter(pk=second.pk).update(state=InstanceState.FAILED)
    families = scrape()
    instances = by_label(families["flotilla_controlplane_instances"], "state")
    assert instances == {state: 0.0 for state in InstanceState.values} | {"ready": 1, "failed": 1, "pending": 1}
    assert by_label(families["flotilla_controlplane_nodes"], "state") == {"online": 1, "offline": 1}


def test_the_reconcilers_passes_are_a_histogram_and_its_lag_is_measured_at_the_scrape() -> None:
    record_pass(LEASE_NAME, time.monotonic() - 0.2, "nothing to do")
    record_pass(LEASE_NAME, time.monotonic() - 3.0, "placed: 1")
    moved = timezone.now() - timedelta(seconds=30)
    ReconcilerPass.objects.update(finished_at=moved)
    families = scrape()
    samples = families["flotilla_controlplane_reconcile_duration_seconds"]
    buckets = {s.labels["le"]: s.value for s in samples if s.name.endswith("_bucket")}
    assert (buckets["0.1"], buckets["0.25"], buckets["2.5"], buckets["5.0"], buckets["+Inf"]) == (0, 1, 1, 2, 2)
    (count,) = [s.value for s in samples if s.name.endswith("_count")]
    (total,) = [s.value for s in samples if s.name.endswith("_sum")]
    assert count == 2
    assert 3.2 <= total < 4
    (lag,) = families["flotilla_controlplane_reconcile_lag_seconds"]
    assert 30 <= lag.value < 40
    (late,) = families["flotilla_controlplane_reconcile_late"]
    assert late.value == 1


def test_before_any_pass_the_lag_is_infinite() -> None:
    families = scrape()
    (lag,) = families["flotilla_controlplane_reconcile_lag_seconds"]
    assert math.isinf(lag.value)


def test_requests_are_timed_by_method_view_name_and_status_class_never_by_path() -> None:
    client = Client()
    assert client.get("/api/v1/health/").status_code in (200, 503)
    assert client.get("/api/v1/nodes/123/").status_code == 401
    assert client.get("/no/such/page/").status_code == 404
    samples = scrape(client)["flotilla_controlplane_request_duration_seconds"]
    counts = {
        (s.labels["method"], s.labels["view"], s.labels["status"]): s.value
        for s in samples
        if s.name.endswith("_count")
    }
    assert sum(count for (_, view, _), count in counts.items() if view == "health") == 1
    assert counts[("GET", "node-detail", "4xx")] >= 1
    assert counts[("GET", "unmatched", "4xx")] >= 1
    assert not [s for s in samples if "123" in str(s.labels)]
