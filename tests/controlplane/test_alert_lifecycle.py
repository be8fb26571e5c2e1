"""An alert's life: it fires and is notified once, stays firing without a second notification, resolves and
is notified as resolved; the webhook is a real local HTTP server (signed when a secret is set), a failing one
is logged and tried again on the next pass; email goes through Django's mail backend."""

import datetime
import hashlib
import hmac
import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from django.core import mail
from django.utils import timezone

from controlplane.alerts.config import AlertSettings
from controlplane.alerts.evaluate import run_pass
from controlplane.alerts.models import Alert, Notified, Rule, Silence
from controlplane.alerts.notify import SIGNATURE_HEADER
from controlplane.alerts.rules import Firing

pytestmark = pytest.mark.django_db


@dataclass
class Receiver:
    """What the webhook server was sent; ``status`` is what it answers."""

    url: str
    bodies: list[dict[str, Any]] = field(default_factory=list)
    signatures: list[str | None] = field(default_factory=list)
    raw: list[bytes] = field(default_factory=list)
    status: int = 200


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """A real HTTP server on a free port that records every POST."""
    holder: list[Receiver] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            target = holder[0]
            target.raw.append(body)
            target.bodies.append(json.loads(body))
            target.signatures.append(self.headers.get(SIGNATURE_HEADER))
            self.send_response(target.status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    holder.append(Receiver(url=f"http://127.0.0.1:{server.server_address[1]}/hook"))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield holder[0]
    server.shutdown()
    server.server_close()
    thread.join()


class Fleet:
    """The rules' answer, set by the test: what fires now."""

    def __init__(self) -> None:
        self.firing: list[Firing] = []

    def rule(self, settings: AlertSettings, now: datetime.datetime) -> list[Firing]:
        return list(self.firing)


NODE_DOWN = Firing(Rule.NODE_OFFLINE, "node", "7", "gpu-a", "node gpu-a is offline")


def a_pass(fleet: Fleet, settings: AlertSettings, now: datetime.datetime | None = None) -> Any:
    return run_pass(settings, now, rules={Rule.NODE_OFFLINE: fleet.rule})


def test_an_alert_is_notified_when_it_fires_not_again_while_it_fires_and_once_when_it_resolves(
    receiver: Receiver,
) -> None:
    fleet, settings = Fleet(), AlertSettings(webhook_url=receiver.url)
    fleet.firing = [NODE_DOWN]
    report = a_pass(fleet, settings)
    assert report.fired == ["node_offline:node:7"]
    [body] = receiver.bodies
    assert body["status"] == "firing" and body["version"] == "4"
    [sent] = body["alerts"]
    assert sent["labels"] == {
        "alertname": "node_offline",
        "severity": "warning",
        "subject_type": "node",
        "subject": "gpu-a",
    }
    assert sent["annotations"]["summary"] == "node gpu-a is offline" and sent["endsAt"] == "0001-01-01T00:00:00Z"
    assert receiver.signatures == [None]  # no secret, no signature

    a_pass(fleet, settings)
    assert len(receiver.bodies) == 1  # still firing: not sent again
    alert = Alert.objects.get()
    assert alert.firing and alert.last_seen_at > alert.first_seen_at

    fleet.firing = []
    report = a_pass(fleet, settings)
    assert report.resolved == ["node_offline:node:7"]
    assert (
        receiver.bodies[1]["status"] == "resolved"
        and receiver.bodies[1]["alerts"][0]["endsAt"] != "0001-01-01T00:00:00Z"
    )
    a_pass(fleet, settings)
    assert len(receiver.bodies) == 2
    assert Alert.objects.get().webhook_sent == Notified.RESOLVED

    fleet.firing = [NODE_DOWN]  # firing again is a new alert, notified again
    a_pass(fleet, settings)
    assert Alert.objects.count() == 2 and receiver.bodies[2]["status"] == "firing"


def test_a_firing_alert_is_sent_again_after_the_renotify_interval(receiver: Receiver) -> None:
    fleet, settings = Fleet(), AlertSettings(webhook_url=receiver.url, renotify_s=3600)
    fleet.firing = [NODE_DOWN]
    start = timezone.now()
    a_pass(fleet, settings, start)
    a_pass(fleet, settings, start + datetime.timedelta(minutes=30))
    assert len(receiver.bodies) == 1
    a_pass(fleet, settings, start + datetime.timedelta(minutes=61))
    assert len(receiver.bodies) == 2 and receiver.bodies[1]["status"] == "firing"


def test_the_body_is_signed_with_the_secret(receiver: Receiver) -> None:
    fleet, settings = Fleet(), AlertSettings(webhook_url=receiver.url, webhook_secret="s3cret")
    fleet.firing = [NODE_DOWN]
    a_pass(fleet, settings)
    expected = "sha256=" + hmac.new(b"s3cret", receiver.raw[0], hashlib.sha256).hexdigest()
    assert receiver.signatures == [expected]


def test_a_failing_webhook_is_logged_and_tried_again_on_the_next_pass(
    receiver: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    fleet, settings = Fleet(), AlertSettings(webhook_url=receiver.url)
    fleet.firing = [NODE_DOWN]
    receiver.status = 503
    with caplog.at_level(logging.WARNING, logger="controlplane.alerts.notify"):
        report = a_pass(fleet, settings)
    assert report.fired and report.notified.errors  # the pass itself went through
    assert "HTTP 503" in caplog.text and "sent again next pass" in caplog.text
    assert Alert.objects.get().webhook_sent == Notified.NOTHING
    receiver.status = 200
    a_pass(fleet, settings)
    assert len(receiver.bodies) == 2 and receiver.bodies[1]["status"] == "firing"
    assert Alert.objects.get().webhook_sent == Notified.FIRING


def test_a_webhook_nobody_listens_on_does_not_fail_the_pass(caplog: pytest.LogCaptureFixture) -> None:
    fleet = Fleet()
    fleet.firing = [NODE_DOWN]
    settings = AlertSettings(webhook_url="http://127.0.0.1:9/hook", webhook_timeout_s=2)
    with caplog.at_level(logging.WARNING, logger="controlplane.alerts.notify"):
        report = a_pass(fleet, settings)
    assert report.fired and "alert webhook http://127.0.0.1:9/hook failed" in caplog.text
    assert Alert.objects.get().firing


def test_email_is_sent_on_firing_and_resolving_when_a_mail_server_is_configured(settings: Any) -> None:
    settings.EMAIL_HOST = "smtp.example.com"
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    fleet, alert_settings = Fleet(), AlertSettings(emails=("ops@example.com",))
    fleet.firing = [NODE_DOWN]
    a_pass(fleet, alert_settings)
    a_pass(fleet, alert_settings)
    [firing] = mail.outbox
    assert firing.to == ["ops@example.com"] and firing.subject.startswith("[Flotilla] 1 firing: node_offline gpu-a")
    assert "node gpu-a is offline" in firing.body
    fleet.firing = []
    a_pass(fleet, alert_settings)
    assert len(mail.outbox) == 2 and "1 resolved" in mail.outbox[1].subject and "RESOLVED" in mail.outbox[1].body


def test_no_email_without_a_mail_server(settings: Any) -> None:
    settings.EMAIL_HOST = ""
    fleet = Fleet()
    fleet.firing = [NODE_DOWN]
    a_pass(fleet, AlertSettings(emails=("ops@example.com",)))
    assert mail.outbox == [] and Alert.objects.get().email_sent == Notified.NOTHING


def test_a_silenced_alert_is_not_notified_and_is_once_its_silence_ends(receiver: Receiver) -> None:
    fleet, settings = Fleet(), AlertSettings(webhook_url=receiver.url)
    now = timezone.now()
    silence = Silence.objects.create(
        rule=Rule.NODE_OFFLINE,
        subject="gpu-a",
        ends_at=now + datetime.timedelta(hours=1),
        comment="maintenance",
        created_by_name="olga",
    )
    fleet.firing = [NODE_DOWN, Firing(Rule.NODE_OFFLINE, "node", "8", "gpu-b", "node gpu-b is offline")]
    a_pass(fleet, settings, now)
    [body] = receiver.bodies
    assert [alert["labels"]["subject"] for alert in body["alerts"]] == ["gpu-b"]
    a_pass(fleet, settings, silence.ends_at + datetime.timedelta(seconds=1))
    assert [alert["labels"]["subject"] for alert in receiver.bodies[1]["alerts"]] == ["gpu-a"]


def test_a_rule_that_fails_leaves_its_alerts_firing(receiver: Receiver) -> None:
    fleet, settings = Fleet(), AlertSettings(webhook_url=receiver.url)
    fleet.firing = [NODE_DOWN]
    a_pass(fleet, settings)

    def broken(settings: AlertSettings, now: datetime.datetime) -> list[Firing]:
        from django.db import DatabaseError

        raise DatabaseError("the table is locked")

    report = run_pass(settings, rules={Rule.NODE_OFFLINE: broken})
    assert report.failed_rules == ["node_offline"] and report.resolved == []
    assert Alert.objects.get().firing


def test_alerts_resolved_and_silences_ended_past_the_keep_time_are_deleted_and_the_rest_kept() -> None:
    fleet, settings = Fleet(), AlertSettings(keep_s=3600)
    start = timezone.now()
    fleet.firing = [NODE_DOWN]
    a_pass(fleet, settings, start)
    fleet.firing = []
    a_pass(fleet, settings, start + datetime.timedelta(minutes=1))  # resolved a minute in
    fleet.firing = [NODE_DOWN]
    a_pass(fleet, settings, start + datetime.timedelta(minutes=2))  # firing again: a new row, never resolved
    Silence.objects.create(rule=Rule.NODE_OFFLINE, ends_at=start, comment="maintenance", created_by_name="alice")
    Silence.objects.create(
        rule=Rule.NODE_OFFLINE, ends_at=start + datetime.timedelta(days=1), comment="longer", created_by_name="alice"
    )

    report = a_pass(fleet, settings, start + datetime.timedelta(minutes=30))
    assert report.pruned == 0 and Alert.objects.count() == 2 and Silence.objects.count() == 2

    report = a_pass(fleet, settings, start + datetime.timedelta(minutes=62))
    assert report.pruned == 2  # the alert resolved 61 minutes before, the silence ended 62 minutes before
    [left] = Alert.objects.all()
    assert left.firing  # a firing alert is never deleted, however old
    assert [silence.comment for silence in Silence.objects.all()] == ["longer"]
