"""Creating and revoking API tokens and people. Each runs in one transaction with an audit entry
(the key itself is never recorded: it is shown once, to whoever created it)."""

import datetime

from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from controlplane.accounts.models import TOKEN_DISPLAY_CHARS, ApiToken, Role, User, hash_token
from controlplane.audit.records import Actor, record, snapshot
from controlplane.errors import Conflict, Invalid

_TOKEN_AUDIT_EXCLUDE = ("key_hash", "last_used_at")
_USER_AUDIT_EXCLUDE = ("password", "last_login")


@transaction.atomic
def create_person_token(
    actor: Actor,
    user: User,
    description: str = "",
    *,
    scope: ApiToken.Scope = ApiToken.Scope.FULL,
    expires_at: datetime.datetime | None = None,
) -> tuple[ApiToken, str]:
    """A new token acting as ``user`` (only reading, with scope "read"), valid until ``expires_at`` (None:
    always); returns the row and the key (shown once, stored hashed). Raises Invalid for a past expiry."""
    token = ApiToken(kind=ApiToken.Kind.PERSON, user=user, description=description, scope=scope)
    return _create(actor, token, expires_at)


@transaction.atomic
def create_agent_token(
    actor: Actor,
    node_name: str,
    description: str = "",
    *,
    expires_at: datetime.datetime | None = None,
    revoke_old: bool = False,
) -> tuple[ApiToken, str]:
    """A new token for the agent of node ``node_name`` (the node need not be registered yet), valid until
    ``expires_at`` (None: always). With ``revoke_old``, the node's other agent tokens are revoked in the
    same transaction: their agent is refused from then on, and their keys sign none of the node's tasks
    (controlplane/accounts/task_keys.py). Raises Invalid for a missing node name or a past expiry."""
    if not node_name:
        raise Invalid("an agent token names its node", field="node_name")
    if revoke_old:
        for old in ApiToken.objects.select_for_update().filter(kind=ApiToken.Kind.AGENT, node_name=node_name):
            revoke_token(actor, old)
    return _create(actor, ApiToken(kind=ApiToken.Kind.AGENT, node_name=node_name, description=description), expires_at)


@transaction.atomic
def revoke_token(actor: Actor, token: ApiToken) -> None:
    """Delete a token; requests with it fail from now on."""
    record(actor, "token.revoke", token, before=snapshot(token, exclude=_TOKEN_AUDIT_EXCLUDE), after=None)
    token.delete()


@transaction.atomic
def create_user(actor: Actor, username: str, role: Role, *, password: str | None = None) -> User:
    """Add a person with a role; without a password they can use tokens but not log in to the dashboard.

    Raises Conflict when the username is taken, Invalid when the password fails the validators
    (settings.AUTH_PASSWORD_VALIDATORS).
    """
    if User.objects.filter(username=username).exists():
        raise Conflict(f"a user named {username!r} exists already")
    user = User(username=username, role=role, is_staff=role == Role.ADMIN)
    if password:
        _check_password(password, user)
        user.set_password(password)
    else:
        user.set_unusable_password()
    user.save()
    record(actor, "user.create", user, before=None, after=snapshot(user, exclude=("password", "last_login")))
    return user


@transaction.atomic
def set_role(actor: Actor, user: User, role: Role) -> User:
    """Change a person's role."""
    before = snapshot(user, exclude=("password", "last_login"))
    user.role = role
    user.is_staff = role == Role.ADMIN or user.is_superuser
    user.save(update_fields=["role", "is_staff"])
    record(actor, "user.role", user, before=before, after=snapshot(user, exclude=("password", "last_login")))
    return user


@transaction.atomic
def save_user(actor: Actor, user: User) -> User:
    """Save a person edited in the admin (a new one, or changes to an existing one's fields), with its
    audit entry. ``is_staff`` follows the role (the admin site is for admins), whatever the form said."""
    old = User.objects.filter(pk=user.pk).first() if user.pk else None
    before = snapshot(old, exclude=_USER_AUDIT_EXCLUDE) if old is not None else None
    user.is_staff = Role(user.role) == Role.ADMIN or user.is_superuser
    user.save()
    after = snapshot(user, exclude=_USER_AUDIT_EXCLUDE)
    if old is not None and user.password != old.password:
        after["password"] = "changed"
    record(actor, "user.create" if old is None else "user.update", user, before=before, after=after)
    return user


@transaction.atomic
def set_password(actor: Actor, user: User, password: str | None) -> User:
    """Give ``user`` a new password (checked by the validators), or none: they can then only use tokens.

    Raises Invalid when the password fails the validators.
    """
    if password is None:
        user.set_unusable_password()
    else:
        _check_password(password, user)
        user.set_password(password)
    user.save(update_fields=["password"])
    change = {"password": "changed" if password is not None else "removed"}
    record(actor, "user.password", user, before=None, after=change)
    return user


@transaction.atomic
def delete_user(actor: Actor, user: User) -> None:
    """Delete a person and their tokens (their audit entries stay, with their name)."""
    record(actor, "user.delete", user, before=snapshot(user, exclude=_USER_AUDIT_EXCLUDE), after=None)
    user.delete()


def _check_password(password: str, user: User) -> None:
    try:
        validate_password(password, user)
    except ValidationError as exc:
        raise Invalid(" ".join(exc.messages), field="password") from exc


def _create(actor: Actor, token: ApiToken, expires_at: datetime.datetime | None) -> tuple[ApiToken, str]:
    if expires_at is not None and expires_at <= timezone.now():
        raise Invalid(f"{expires_at.isoformat()} is past: a token expires in the future", field="expires_at")
    token.expires_at = expires_at
    key = ApiToken.new_key()
    token.key_hash = hash_token(key)
    token.key_start = key[:TOKEN_DISPLAY_CHARS]
    token.save()
    record(actor, "token.create", token, before=None, after=snapshot(token, exclude=_TOKEN_AUDIT_EXCLUDE))
    return token, key
