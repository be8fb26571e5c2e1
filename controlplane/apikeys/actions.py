"""Changes to API keys. Each runs in one transaction with an audit entry, and once it commits the key's
new record goes to the ingress processes (``publication.publish_after_commit``).

Operators create and manage their own keys; admins anyone's (the views check who may act on which).
A person's keys follow their account: deactivating them suspends their live keys, reactivating them
restores those keys (``follow_owner``, called by ``accounts.actions``).
"""

import datetime
from collections.abc import Sequence

from django.db import IntegrityError, transaction
from django.utils import timezone

from controlplane.accounts.models import User
from controlplane.apikeys.models import KEY_DISPLAY_CHARS, ApiKey
from controlplane.apikeys.publication import publish_after_commit
from controlplane.audit.records import Actor, record, snapshot
from controlplane.errors import Conflict, Invalid
from runtime.fleet_contract.api_keys import key_hash, new_key

# The hash is no secret, but it is nothing a person needs to read either.
_AUDIT_EXCLUDE = ("key_hash",)


@transaction.atomic
def create_key(
    actor: Actor,
    owner: User,
    name: str,
    *,
    allowed_models: Sequence[str] = (),
    expires_at: datetime.datetime | None = None,
    requests_per_minute: int | None = None,
    tokens_per_minute: int | None = None,
    monthly_token_budget: int | None = None,
    max_concurrent_requests: int | None = None,
) -> tuple[ApiKey, str]:
    """A new key for ``owner``; returns the row and the key itself (shown once, stored hashed).

    Raises Invalid for a past expiry, Conflict when the owner has a live key of that name already or is
    deactivated.
    """
    if expires_at is not None and expires_at <= timezone.now():
        raise Invalid("expires_at is in the past", field="expires_at")
    # The owner's row locked until this commits: a deactivation committing meanwhile would not see this key
    # to suspend it (the forms offer active people only, but one may be deactivated after the form was sent).
    owner = User.objects.select_for_update(no_key=True).get(pk=owner.pk)
    if not owner.is_active:
        raise Conflict(f"{owner.get_username()} is deactivated: reactivate them before making them a key")
    secret = new_key()
    key = ApiKey(
        name=name,
        owner=owner,
        key_hash=key_hash(secret),
        key_start=secret[:KEY_DISPLAY_CHARS],
        allowed_models=sorted(set(allowed_models)),
        expires_at=expires_at,
        requests_per_minute=requests_per_minute,
        tokens_per_minute=tokens_per_minute,
        monthly_token_budget=monthly_token_budget,
        max_concurrent_requests=max_concurrent_requests,
    )
    try:
        with transaction.atomic():
            key.save()
    except IntegrityError as exc:
        raise Conflict(f"{owner.get_username()} has a key named {name!r} already; pick another name") from exc
    record(actor, "api_key.create", key, before=None, after=snapshot(key, exclude=_AUDIT_EXCLUDE))
    publish_after_commit(key)
    return key, secret


@transaction.atomic
def revoke_key(actor: Actor, key: ApiKey) -> ApiKey:
    """Revoke a key: every ingress refuses it once its record arrives. Raises Conflict when it is revoked."""
    key = ApiKey.objects.select_for_update().select_related("owner").get(pk=key.pk)
    if key.revoked:
        raise Conflict(f"key {key.name} ({key.key_start}…) was revoked already")
    before = snapshot(key, exclude=_AUDIT_EXCLUDE)
    key.revoked_at = timezone.now()
    key.version += 1
    key.save(update_fields=["revoked_at", "version"])
    record(actor, "api_key.revoke", key, before=before, after=snapshot(key, exclude=_AUDIT_EXCLUDE))
    publish_after_commit(key)
    return key


@transaction.atomic
def follow_owner(actor: Actor, owner: User) -> list[ApiKey]:
    """Publish again the live keys of ``owner``, whose account was just deactivated or reactivated (call it
    in that action's transaction, with ``owner`` as saved): suspended while they are inactive, working again
    once they are active. Returns those keys.

    Each key's version grows, so that every ingress takes the new record over the one it has, and a copy of
    the record from before the change, put back in etcd, is older and ignored.
    """
    keys = list(ApiKey.objects.select_for_update().filter(owner=owner, revoked_at__isnull=True).order_by("pk"))
    action = "api_key.suspend" if not owner.is_active else "api_key.restore"
    for key in keys:
        key.owner = owner  # as just saved: whether the key is suspended follows owner.is_active
        before = {**snapshot(key, exclude=_AUDIT_EXCLUDE), "suspended": not key.suspended}  # the change flips it
        key.version += 1
        key.save(update_fields=["version"])
        after = {**snapshot(key, exclude=_AUDIT_EXCLUDE), "suspended": key.suspended}
        record(actor, action, key, before=before, after=after)
    publish_after_commit(*keys)
    return keys
