"""API keys for the OpenAI endpoint: who holds each, what it may use, its limits, and whether it still works.

Not the control plane's own tokens (``accounts.ApiToken``, for this API and the agents): these open the
ingress's ``/v1/*`` to applications. The key is shown once and stored as its SHA-256; each ingress
learns of keys from signed records in etcd (``runtime/fleet_contract/api_keys.py``, published by ``publication.py``).
"""

from typing import ClassVar

from django.conf import settings
from django.db import models
from django.db.models import Q

from controlplane.accounts.models import Role, User
from runtime.fleet_contract.api_keys import KeyRecord

# Shown in listings so that a person can tell keys apart: "sk-flt-" and the next five characters.
KEY_DISPLAY_CHARS = 12


class ApiKey(models.Model):
    """One application's key. ``allowed_models`` empty means every model; a limit left empty means none.

    Its states: active -> revoked (``revoked_at`` set, for good), and, while its owner is deactivated,
    suspended (refused by every ingress, back to active when the owner is reactivated)::

        active --revoke_key--> revoked
        active --owner deactivated--> suspended --owner reactivated--> active
        suspended --revoke_key--> revoked
    """

    name = models.CharField(max_length=100)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="api_keys")
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    key_start = models.CharField(max_length=KEY_DISPLAY_CHARS, editable=False)
    allowed_models = models.JSONField(default=list, blank=True)  # served model names; [] = all
    expires_at = models.DateTimeField(null=True, blank=True)
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    tokens_per_minute = models.PositiveIntegerField(null=True, blank=True)
    monthly_token_budget = models.PositiveBigIntegerField(null=True, blank=True)
    # Requests served at once per ingress process; empty: the ingress's --max-concurrent-per-key, if any.
    max_concurrent_requests = models.PositiveIntegerField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # Grows with every change, so that an ingress can tell a newer record from an older one.
    version = models.PositiveIntegerField(default=1)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering: ClassVar = ["id"]
        constraints: ClassVar = [
            models.UniqueConstraint(
                fields=["owner", "name"], condition=Q(revoked_at__isnull=True), name="unique_live_key_name_per_owner"
            )
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.key_start}…, {self.owner})"

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    @property
    def suspended(self) -> bool:
        """Refused for now because its owner is deactivated; it works again when they are reactivated
        (``actions.follow_owner``). A revoked key is revoked, not suspended."""
        return not self.revoked and not self.owner.is_active

    @staticmethod
    def visible_to(person: object) -> "models.QuerySet[ApiKey]":
        """The keys ``person`` may see and manage, with their owners: their own, or everyone's for an admin
        (another's key is then a 404 to them, as if it did not exist)."""
        keys = ApiKey.objects.select_related("owner")
        if not isinstance(person, User):
            return keys.none()
        return keys if person.has_role(Role.ADMIN) else keys.filter(owner=person)

    def record(self) -> KeyRecord:
        """What the ingress processes are told of this key."""
        return KeyRecord(
            key_id=self.pk,
            name=self.name,
            owner=self.owner.get_username(),
            models=list(self.allowed_models) or None,
            expires_at=None if self.expires_at is None else self.expires_at.timestamp(),
            requests_per_minute=self.requests_per_minute,
            tokens_per_minute=self.tokens_per_minute,
            monthly_token_budget=self.monthly_token_budget,
            max_concurrent_requests=self.max_concurrent_requests,
            # Revoked too while suspended: an ingress that does not know ``suspended`` refuses it as well.
            revoked=self.revoked or self.suspended,
            suspended=self.suspended,
            version=self.version,
        )


class KeyUsage(models.Model):
    """What one key used of one model on one UTC day, as the ingress processes counted it (drained from
    Redis by ``usage.drain``)."""

    key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="usage")
    model = models.CharField(max_length=200)
    day = models.DateField()
    requests = models.PositiveBigIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0)  # prompt tokens found in an engine's cache
    completion_tokens = models.PositiveBigIntegerField(default=0)
    errors = models.PositiveBigIntegerField(default=0)

    class Meta:
        ordering: ClassVar = ["day", "key_id", "model"]
        constraints: ClassVar = [models.UniqueConstraint(fields=["key", "model", "day"], name="one_usage_row_per_day")]

    def __str__(self) -> str:
        return f"{self.key_id} {self.model} {self.day}: {self.requests} requests"


class UsageBatch(models.Model):
    """A batch of counts taken from Redis and added to ``KeyUsage``, by its claimed name: added in the same
    transaction as the counts, so a batch whose deletion from Redis failed is not added twice."""

    name = models.CharField(max_length=200, unique=True)
    drained_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.name
