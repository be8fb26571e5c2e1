"""Alerts: a condition of the fleet that needs an operator (a crash loop, a node offline, ...), from the time a
rule first saw it until it was gone; and silences, which keep matching alerts from being notified."""

from typing import ClassVar

from django.conf import settings
from django.db import models
from django.db.models import Q


class Rule(models.TextChoices):
    CRASH_LOOP = "crash_loop", "Crash loop"
    UNSCHEDULABLE = "unschedulable", "Unschedulable"
    NODE_OFFLINE = "node_offline", "Node offline"
    KEY_BUDGET = "key_budget", "Key budget reached"
    TTFT_OVER_TARGET = "ttft_over_target", "TTFT over target"


class Severity(models.TextChoices):
    WARNING = "warning"
    CRITICAL = "critical"


class Notified(models.TextChoices):
    """What a channel was last told of an alert."""

    NOTHING = ""
    FIRING = "firing"
    RESOLVED = "resolved"


class Alert(models.Model):
    """One firing of one rule about one subject::

        (a rule fires) ──► firing ──(the rule no longer fires)──► resolved  (final; a new firing is a new row)

    ``fingerprint`` (rule and subject) is unique among firing alerts. ``webhook_sent`` and ``email_sent`` say
    what each channel was told last (a failed send leaves them, so the next pass tries again);
    ``notified_at`` is when a firing was last sent, for re-notification.
    """

    rule = models.CharField(max_length=24, choices=Rule.choices)
    subject_type = models.CharField(max_length=16)  # "instance", "node", "api_key", "pipeline"
    subject_id = models.CharField(max_length=64)
    subject_name = models.CharField(max_length=255)  # what a person calls it; silences match it
    severity = models.CharField(max_length=8, choices=Severity.choices, default=Severity.WARNING)
    message = models.TextField()
    fingerprint = models.CharField(max_length=128)
    first_seen_at = models.DateTimeField()
    last_seen_at = models.DateTimeField()
    resolved_at = models.DateTimeField(null=True, blank=True, db_index=True)
    webhook_sent = models.CharField(max_length=8, choices=Notified.choices, default=Notified.NOTHING, blank=True)
    email_sent = models.CharField(max_length=8, choices=Notified.choices, default=Notified.NOTHING, blank=True)
    notified_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering: ClassVar = ["-first_seen_at", "-id"]
        constraints: ClassVar = [
            models.UniqueConstraint(
                fields=["fingerprint"], condition=Q(resolved_at__isnull=True), name="one_firing_alert_per_fingerprint"
            )
        ]

    def __str__(self) -> str:
        return f"{self.rule} {self.subject_name} ({'resolved' if self.resolved_at else 'firing'})"

    @property
    def firing(self) -> bool:
        return self.resolved_at is None


class Silence(models.Model):
    """Alerts matching ``rule`` (blank: any) and ``subject`` (blank: any; an alert's ``subject_name``) are not
    notified until ``ends_at``; they still show, marked silenced. Expiring one sets ``ends_at`` to now."""

    rule = models.CharField(max_length=24, choices=Rule.choices, blank=True)
    subject = models.CharField(max_length=255, blank=True)
    ends_at = models.DateTimeField(db_index=True)
    comment = models.TextField()
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_by_name = models.CharField(max_length=160)  # kept when the account is gone
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering: ClassVar = ["-created_at", "-id"]
        constraints: ClassVar = [
            models.CheckConstraint(name="silence_matches_something", condition=~Q(rule="", subject=""))
        ]

    def __str__(self) -> str:
        return f"silence {self.rule or '*'} {self.subject or '*'} until {self.ends_at:%Y-%m-%d %H:%M}"

    def matches(self, alert: Alert) -> bool:
        return (not self.rule or self.rule == alert.rule) and (not self.subject or self.subject == alert.subject_name)
