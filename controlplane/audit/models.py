"""The audit log: one row per change of desired or actual state, written by the action that made it."""

from typing import ClassVar

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models


class AuditEntry(models.Model):
    """Who did what to which record, when, and the record before and after (None: created / deleted)."""

    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    # The person, if a person did it; kept as a name too, so the log outlives the account.
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    actor_name = models.CharField(max_length=160, db_index=True)  # "alice", "agent:gpu-a", "system:reconciler"
    action = models.CharField(max_length=64, db_index=True)  # "pipeline.deploy", "instance.state", ...
    target_type = models.CharField(max_length=32, db_index=True)  # "pipeline", "node", ...
    target_id = models.CharField(max_length=64, db_index=True)
    target_name = models.CharField(max_length=255, blank=True)
    before = models.JSONField(null=True, blank=True, encoder=DjangoJSONEncoder)
    after = models.JSONField(null=True, blank=True, encoder=DjangoJSONEncoder)

    class Meta:
        ordering: ClassVar = ["-created_at", "-id"]
        verbose_name_plural = "audit entries"

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M} {self.actor_name} {self.action} {self.target_type}:{self.target_id}"
