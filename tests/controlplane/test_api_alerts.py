"""/api/v1/alerts/ and /api/v1/silences/: everyone reads, operators and admins silence (read-only people
get 403), bad input is a 400 naming the field, expiring ends a silence now."""

import datetime

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.alerts.models import Alert, Rule, Silence
from controlplane.audit.models import AuditEntry
from tests.controlplane.factories import deploy

pytestmark = pytest.mark.django_db


def make_alert(subject: str = "gpu-a", *, resolved: bool = False) -> Alert:
    now = timezone.now()
    return Alert.objects.create(
        rule=Rule.NODE_OFFLINE,
        subject_type="node",
        subject_id=subject,
        subject_name=subject,
        message=f"node {subject} is offline",
        fingerprint=f"node_offline:node:{subject}",
        first_seen_at=now,
        last_seen_at=now,
        resolved_at=now if resolved else None,
    )


def test_alerts_are_listed_and_filtered_by_firing(reader: APIClient) -> None:
    make_alert("gpu-a")
    make_alert("gpu-b", resolved=True)
    everything = reader.get("/api/v1/alerts/").json()["results"]
    assert sorted(alert["subject_name"] for alert in everything) == ["gpu-a", "gpu-b"]
    [firing] = reader.get("/api/v1/alerts/?firing=true").json()["results"]
    assert firing["subject_name"] == "gpu-a" and firing["firing"] and firing["silenced_by"] is None


def test_an_operator_silences_an_alert_and_it_shows_as_silenced(operator: APIClient, reader: APIClient) -> None:
    make_alert("gpu-a")
    answer = operator.post(
        "/api/v1/silences/",
        {"rule": "node_offline", "subject": "gpu-a", "duration_s": 3600, "comment": "reboot"},
        format="json",
    )
    assert answer.status_code == 201, answer.json()
    silence = answer.json()
    assert silence["active"] and silence["comment"] == "reboot"
    [alert] = reader.get("/api/v1/alerts/").json()["results"]
    assert alert["silenced_by"] == silence["id"]
    assert AuditEntry.objects.filter(action="silence.create").count() == 1


def test_expiring_a_silence_ends_it_now_and_a_second_expiry_is_a_conflict(operator: APIClient) -> None:
    silence = operator.post(
        "/api/v1/silences/", {"subject": "gpu-a", "duration_s": 600, "comment": "x"}, format="json"
    ).json()
    answer = operator.delete(f"/api/v1/silences/{silence['id']}/")
    assert answer.status_code == 200 and not answer.json()["active"]
    assert Silence.objects.get().ends_at <= timezone.now()
    assert operator.delete(f"/api/v1/silences/{silence['id']}/").status_code == 409


def test_read_only_people_may_list_silences_but_not_make_or_expire_them(reader: APIClient, operator: APIClient) -> None:
    silence = operator.post(
        "/api/v1/silences/", {"subject": "gpu-a", "duration_s": 600, "comment": "x"}, format="json"
    ).json()
    assert reader.get("/api/v1/silences/").status_code == 200
    assert (
        reader.post(
            "/api/v1/silences/", {"subject": "gpu-b", "duration_s": 600, "comment": "x"}, format="json"
        ).status_code
        == 403
    )
    assert reader.delete(f"/api/v1/silences/{silence['id']}/").status_code == 403
    assert Silence.objects.count() == 1


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"duration_s": 600, "comment": "x"}, "rule", "needs a rule or a subject"),
        ({"rule": "sunspots", "duration_s": 600, "comment": "x"}, "rule", "sunspots"),
        ({"subject": "gpu-a", "comment": "x"}, "ends_at", "ends_at or duration_s"),
        ({"subject": "gpu-a", "ends_at": "2001-01-01T00:00:00Z", "comment": "x"}, "ends_at", "future"),
        ({"subject": "gpu-a", "duration_s": 90 * 86400, "comment": "x"}, "ends_at", "30 days"),
        ({"subject": "gpu-a", "duration_s": 600, "comment": "  "}, "comment", ""),
        ({"subject": "gpu-a", "duration_s": "soon", "comment": "x"}, "duration_s", "integer"),
    ],
)
def test_a_bad_silence_is_a_400_naming_the_field(
    operator: APIClient, body: dict[str, object], field: str, words: str
) -> None:
    answer = operator.post("/api/v1/silences/", body, format="json")
    assert answer.status_code == 400
    problem = answer.json()
    assert field in str(problem) and words in str(problem), problem
    assert Silence.objects.count() == 0


def test_a_silence_until_a_time_is_taken(operator: APIClient) -> None:
    until = (timezone.now() + datetime.timedelta(hours=2)).isoformat()
    answer = operator.post(
        "/api/v1/silences/", {"rule": "key_budget", "ends_at": until, "comment": "raising it"}, format="json"
    )
    assert answer.status_code == 201 and answer.json()["rule"] == "key_budget"


def test_a_pipelines_ttft_target_is_set_and_cleared_through_the_api(operator: APIClient) -> None:
    pipeline = deploy("chat")
    answer = operator.patch(f"/api/v1/pipelines/{pipeline.pk}/", {"ttft_target_ms": 800}, format="json")
    assert answer.status_code == 200, answer.json()
    assert answer.json()["ttft_target_ms"] == 800
    bad = operator.patch(f"/api/v1/pipelines/{pipeline.pk}/", {"ttft_target_ms": 0}, format="json")
    assert bad.status_code == 400 and "ttft_target_ms" in bad.json()
    cleared = operator.patch(f"/api/v1/pipelines/{pipeline.pk}/", {"ttft_target_ms": None}, format="json")
    assert cleared.status_code == 200 and cleared.json()["ttft_target_ms"] is None
