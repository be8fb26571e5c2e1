"""One pass of the alerts: every rule evaluated, what fires recorded as alert rows, then notified.

New firings become alert rows, alerts still firing have ``last_seen_at`` (and their message) updated, and
firing alerts no rule returned any more are resolved. A rule that fails (the database, a bad setting) is
logged and its alerts are left as they were: a rule that cannot look must not resolve what it saw before.
Notifying (``notify.notify``) comes after the rows' transaction: no HTTP call holds it open.
"""

import datetime
import logging
from dataclasses import dataclass, field

from django.db import DatabaseError, IntegrityError, transaction
from django.utils import timezone

from controlplane.alerts.config import AlertSettings
from controlplane.alerts.models import Alert, Notified, Rule, Silence
from controlplane.alerts.notify import NotifyReport, notify
from controlplane.alerts.rules import RULES, Firing, RuleFunction
from runtime.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class PassReport:
    fired: list[str] = field(default_factory=list)  # fingerprints of the alerts that began firing
    resolved: list[str] = field(default_factory=list)
    firing: int = 0
    failed_rules: list[str] = field(default_factory=list)
    notified: NotifyReport | None = None
    pruned: int = 0  # resolved alerts and ended silences deleted, past FLOTILLA_ALERT_KEEP_S


def run_pass(
    settings: AlertSettings | None = None,
    now: datetime.datetime | None = None,
    rules: dict[Rule, RuleFunction] | None = None,
) -> PassReport:
    """Evaluate ``rules`` (default: all), record the result, notify. Returns what changed."""
    settings = settings or AlertSettings.from_env()
    now = now or timezone.now()
    firing: list[Firing] = []
    failed: set[Rule] = set()
    for rule, function in (rules or RULES).items():
        try:
            firing.extend(function(settings, now))
        except (DatabaseError, ConfigError) as exc:
            log.error("alert rule %s not evaluated: %s; its alerts stay as they were until the next pass", rule, exc)
            failed.add(rule)
    report = record_firings(firing, now, skip_resolving=failed)
    report.failed_rules = sorted(failed)
    report.notified = notify(settings, now)
    report.pruned = prune(settings, now)
    return report


def prune(settings: AlertSettings, now: datetime.datetime) -> int:
    """Delete the alerts resolved, and the silences ended, more than ``keep_s`` ago (the table would grow for
    ever otherwise); returns how many rows went. A resolution still unsent that long is given up, logged."""
    before = now - datetime.timedelta(seconds=settings.keep_s)
    old = Alert.objects.filter(resolved_at__lt=before)
    unsent = old.exclude(webhook_sent=Notified.RESOLVED).exclude(webhook_sent=Notified.NOTHING).count()
    if unsent and settings.webhook_url:
        log.warning(
            "%d resolved alert(s) never sent as resolved by webhook are deleted after %g s", unsent, settings.keep_s
        )
    alerts, _ = old.delete()
    silences, _ = Silence.objects.filter(ends_at__lt=before).delete()
    if alerts or silences:
        log.info(
            "deleted %d resolved alert(s) and %d ended silence(s) older than %g s", alerts, silences, settings.keep_s
        )
    return alerts + silences


@transaction.atomic
def record_firings(firing: list[Firing], now: datetime.datetime, *, skip_resolving: set[Rule]) -> PassReport:
    """Create, update and resolve alert rows so that the firing ones are exactly ``firing`` (leaving the
    alerts of the rules in ``skip_resolving`` firing)."""
    report = PassReport()
    open_alerts = {alert.fingerprint: alert for alert in Alert.objects.select_for_update().filter(resolved_at=None)}
    seen: set[str] = set()
    for item in firing:
        if item.fingerprint in seen:
            continue
        seen.add(item.fingerprint)
        alert = open_alerts.get(item.fingerprint)
        if alert is not None:
            alert.last_seen_at = now
            alert.message, alert.severity, alert.subject_name = item.message, item.severity, item.subject_name
            alert.save(update_fields=["last_seen_at", "message", "severity", "subject_name"])
            continue
        try:
            # A savepoint: a second pass at the same moment may have made this alert already.
            with transaction.atomic():
                Alert.objects.create(
                    rule=item.rule,
                    subject_type=item.subject_type,
                    subject_id=item.subject_id,
                    subject_name=item.subject_name,
                    severity=item.severity,
                    message=item.message,
                    fingerprint=item.fingerprint,
                    first_seen_at=now,
                    last_seen_at=now,
                )
        except IntegrityError:
            log.info("alert %s was recorded by another pass at the same time", item.fingerprint)
            continue
        report.fired.append(item.fingerprint)
        log.warning("alert firing: %s", item.message)
    for fingerprint, alert in open_alerts.items():
        if fingerprint in seen or alert.rule in skip_resolving:
            continue
        alert.resolved_at = now
        alert.save(update_fields=["resolved_at"])
        report.resolved.append(fingerprint)
        log.info("alert resolved: %s", alert.message)
    report.firing = len(seen)
    return report
