"""Telling people about alerts: a webhook (Alertmanager's webhook body) and email, once when an alert fires
and once when it resolves, never while a silence matches it.

Each channel keeps what it told of each alert (``Alert.webhook_sent``, ``email_sent``). A pass sends every
alert a channel has not been told of in one request (one POST, one email); a failed send is logged and
changes nothing, so the next pass sends it again. A firing alert is sent again after
``FLOTILLA_ALERT_RENOTIFY_S`` when that is set. An alert that resolves while silenced is marked told without
a message (no one was told it fired, or the silence says not to bother them).
"""

import datetime
import hashlib
import hmac
import json
import logging
import smtplib
from dataclasses import dataclass, field
from typing import Any

import httpx
from django.conf import settings as django_settings
from django.core.mail import send_mail
from django.db.models import Q
from django.utils import timezone

from controlplane.alerts.config import AlertSettings
from controlplane.alerts.models import Alert, Notified, Silence

log = logging.getLogger(__name__)

#: The header of the body's signature when FLOTILLA_ALERT_WEBHOOK_SECRET is set: ``sha256=<hex HMAC-SHA256>``.
SIGNATURE_HEADER = "X-Flotilla-Signature"
# Alertmanager's "no end yet".
_NO_END = "0001-01-01T00:00:00Z"


@dataclass
class NotifyReport:
    webhook: list[str] = field(default_factory=list)  # fingerprints sent, with their status
    email: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def active_silences(now: datetime.datetime) -> list[Silence]:
    return list(Silence.objects.filter(ends_at__gt=now))


def silenced_by(alert: Alert, silences: list[Silence]) -> Silence | None:
    """The first of ``silences`` that matches ``alert``, or None."""
    return next((silence for silence in silences if silence.matches(alert)), None)


def notify(settings: AlertSettings, now: datetime.datetime | None = None) -> NotifyReport:
    """Send each configured channel what it has not been told yet. Never raises for a failed send."""
    now = now or timezone.now()
    report = NotifyReport()
    email_on = bool(settings.emails) and bool(getattr(django_settings, "EMAIL_HOST", ""))
    if not settings.webhook_url and not email_on:
        return report
    silences = active_silences(now)
    candidates = list(
        Alert.objects.filter(
            Q(resolved_at=None) | Q(webhook_sent=Notified.FIRING) | Q(email_sent=Notified.FIRING)
        ).order_by("first_seen_at", "id")
    )
    if settings.webhook_url:
        due = _due(candidates, "webhook_sent", settings, silences, now)
        if due and _send_webhook(settings, due, report):
            _mark(due, "webhook_sent", now)
            report.webhook = [f"{alert.fingerprint}={status}" for alert, status in due]
    if email_on:
        due = _due(candidates, "email_sent", settings, silences, now)
        if due and _send_email(settings, due, report):
            _mark(due, "email_sent", now)
            report.email = [f"{alert.fingerprint}={status}" for alert, status in due]
    return report


def _due(
    alerts: list[Alert], channel: str, settings: AlertSettings, silences: list[Silence], now: datetime.datetime
) -> list[tuple[Alert, Notified]]:
    """What ``channel`` must be sent now: (alert, firing or resolved). Silenced resolutions are marked told."""
    due: list[tuple[Alert, Notified]] = []
    renotify_before = now - datetime.timedelta(seconds=settings.renotify_s) if settings.renotify_s else None
    for alert in alerts:
        told = getattr(alert, channel)
        silence = silenced_by(alert, silences)
        if alert.firing:
            if silence is not None:
                continue
            stale = (
                renotify_before is not None and alert.notified_at is not None and alert.notified_at <= renotify_before
            )
            if told != Notified.FIRING or stale:
                due.append((alert, Notified.FIRING))
        elif told == Notified.FIRING:
            if silence is not None:
                log.info("alert %s resolved while silenced (%s): not notified", alert.fingerprint, silence)
                Alert.objects.filter(pk=alert.pk).update(**{channel: Notified.RESOLVED})
                continue
            due.append((alert, Notified.RESOLVED))
    return due


def _mark(due: list[tuple[Alert, Notified]], channel: str, now: datetime.datetime) -> None:
    for alert, status in due:
        fields: dict[str, Any] = {channel: status}
        if status == Notified.FIRING:
            fields["notified_at"] = now
            alert.notified_at = now
        setattr(alert, channel, status)
        Alert.objects.filter(pk=alert.pk).update(**fields)


def webhook_body(due: list[tuple[Alert, Notified]]) -> dict[str, Any]:
    """Alertmanager's webhook body (version 4) for these alerts: receivers written for Alertmanager read it."""
    alerts = [
        {
            "status": str(status),
            "labels": {
                "alertname": alert.rule,
                "severity": alert.severity,
                "subject_type": alert.subject_type,
                "subject": alert.subject_name,
            },
            "annotations": {"summary": alert.message},
            "startsAt": _iso(alert.first_seen_at),
            "endsAt": _iso(alert.resolved_at) if alert.resolved_at else _NO_END,
            "generatorURL": "",
            "fingerprint": alert.fingerprint,
        }
        for alert, status in due
    ]
    firing = any(status == Notified.FIRING for _, status in due)
    return {
        "version": "4",
        "receiver": "flotilla",
        "status": "firing" if firing else "resolved",
        "groupKey": "flotilla",
        "truncatedAlerts": 0,
        "groupLabels": {},
        "commonLabels": {},
        "commonAnnotations": {},
        "externalURL": "",
        "alerts": alerts,
    }


def sign(secret: str, body: bytes) -> str:
    """The signature header's value: ``sha256=`` and the hex HMAC-SHA256 of the body under the secret."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def _send_webhook(settings: AlertSettings, due: list[tuple[Alert, Notified]], report: NotifyReport) -> bool:
    body = json.dumps(webhook_body(due)).encode()
    headers = {"Content-Type": "application/json"}
    if settings.webhook_secret:
        headers[SIGNATURE_HEADER] = sign(settings.webhook_secret, body)
    try:
        response = httpx.post(settings.webhook_url, content=body, headers=headers, timeout=settings.webhook_timeout_s)
    except httpx.HTTPError as exc:
        problem = f"{exc or type(exc).__name__}"
    else:
        if response.is_success:
            return True
        problem = f"HTTP {response.status_code}"
    message = f"alert webhook {settings.webhook_url} failed ({problem}): {len(due)} alert(s) sent again next pass"
    log.warning(message)
    report.errors.append(message)
    return False


def _send_email(settings: AlertSettings, due: list[tuple[Alert, Notified]], report: NotifyReport) -> bool:
    firing = [alert for alert, status in due if status == Notified.FIRING]
    resolved = [alert for alert, status in due if status == Notified.RESOLVED]
    parts = [f"{len(firing)} firing" if firing else "", f"{len(resolved)} resolved" if resolved else ""]
    subject = f"[Flotilla] {', '.join(part for part in parts if part)}: " + ", ".join(
        f"{alert.rule} {alert.subject_name}" for alert, _ in due[:3]
    )
    lines = [f"FIRING  [{alert.severity}] {alert.message} (since {_iso(alert.first_seen_at)})" for alert in firing]
    lines += [f"RESOLVED {alert.message} (at {_iso(alert.resolved_at)})" for alert in resolved if alert.resolved_at]
    try:
        send_mail(subject[:200], "\n".join(lines) + "\n", None, list(settings.emails))
    except (smtplib.SMTPException, OSError) as exc:
        message = f"alert email to {', '.join(settings.emails)} failed ({exc}): sent again next pass"
        log.warning(message)
        report.errors.append(message)
        return False
    return True


def _iso(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.UTC).isoformat().replace("+00:00", "Z")
