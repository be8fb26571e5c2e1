"""Creating and revoking API tokens; adding, editing, deactivating people and setting their passwords.
Each runs in one transaction with an audit entry (a key or a password is never recorded: it is shown once,
to whoever created it).

The fleet always keeps an active admin: a change that would leave none (deactivating or demoting the last
one, in the dashboard, the API or the Django admin) is refused with Conflict, under a lock on the admins'
rows so that two admins demoting each other at once cannot both succeed.
"""

import datetime
import secrets

from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from controlplane.accounts import throttle
from controlplane.accounts.models import TOKEN_DISPLAY_CHARS, ApiToken, Role, User, hash_token
from controlplane.apikeys.actions import follow_owner
from controlplane.audit.records import Actor, record, snapshot
from controlplane.errors import Conflict, Forbidden, Invalid

_TOKEN_AUDIT_EXCLUDE = ("key_hash", "last_used_at")
_USER_AUDIT_EXCLUDE = ("password", "last_login")
# Who counts as an admin: active, with the admin role or a superuser (User.effective_role).
_ACTIVE_ADMINS = Q(is_active=True) & (Q(role=Role.ADMIN) | Q(is_superuser=True))
# Bytes of randomness in a generated password (32 characters), doubled while the validators want more.
_GENERATED_PASSWORD_BYTES = 24


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
def create_user(
    actor: Actor,
    username: str,
    role: Role,
    *,
    password: str | None = None,
    email: str = "",
    first_name: str = "",
    last_name: str = "",
) -> User:
    """Add a person with a role; without a password they can use tokens but not log in to the dashboard.

    Raises Conflict when the username is taken, Invalid when the password fails the validators
    (settings.AUTH_PASSWORD_VALIDATORS).
    """
    if User.objects.filter(username=username).exists():
        raise Conflict(f"a user named {username!r} exists already")
    user = User(
        username=username,
        role=role,
        is_staff=role == Role.ADMIN,
        email=email,
        first_name=first_name,
        last_name=last_name,
    )
    if password:
        _check_password(password, user)
        user.set_password(password)
    else:
        user.set_unusable_password()
    user.save()
    record(actor, "user.create", user, before=None, after=snapshot(user, exclude=_USER_AUDIT_EXCLUDE))
    return user


@transaction.atomic
def update_user(
    actor: Actor,
    user: User,
    *,
    role: Role | None = None,
    email: str | None = None,
    first_name: str | None = None,
    last_name: str | None = None,
) -> User:
    """Change what is given of a person's role, email and names (None: unchanged); returns the person.

    Raises Conflict when the change would demote the last active admin.
    """
    user = _locked(user)
    before = snapshot(user, exclude=_USER_AUDIT_EXCLUDE)
    was_admin = _is_active_admin(user)
    if role is not None:
        user.role = role
        user.is_staff = role == Role.ADMIN or user.is_superuser
    for field, value in (("email", email), ("first_name", first_name), ("last_name", last_name)):
        if value is not None:
            setattr(user, field, value)
    if was_admin and not _is_active_admin(user):
        _keep_an_admin(actor, user, "demoting")
    user.save(update_fields=["role", "is_staff", "email", "first_name", "last_name"])
    record(actor, "user.update", user, before=before, after=snapshot(user, exclude=_USER_AUDIT_EXCLUDE))
    return user


@transaction.atomic
def deactivate_user(actor: Actor, user: User) -> User:
    """Stop a person: from now on their logins, sessions, tokens and websockets are refused, and every ingress
    refuses their API keys (suspended: published so once this commits). Their tokens and keys stay, and work
    again if they are reactivated; revoke them to end them for good. Returns the person.

    Raises Conflict when they are inactive already, or are the last active admin.
    """
    user = _locked(user)
    if not user.is_active:
        raise Conflict(f"{user.username} is inactive already")
    if _is_active_admin(user):
        _keep_an_admin(actor, user, "deactivating")
    return _set_active(actor, user, active=False)


@transaction.atomic
def reactivate_user(actor: Actor, user: User) -> User:
    """Let a deactivated person in again, with the role, password, tokens and API keys they had (the keys
    published active again once this commits). Raises Conflict when they are active already."""
    user = _locked(user)
    if user.is_active:
        raise Conflict(f"{user.username} is active already")
    return _set_active(actor, user, active=True)


def generate_password() -> str:
    """A random password that passes the validators (32 URL-safe characters, or more when they want more)."""
    size = _GENERATED_PASSWORD_BYTES
    while True:
        password = secrets.token_urlsafe(size)
        try:
            validate_password(password)
        except ValidationError:
            if size > 1024:
                raise
            size *= 2
        else:
            return password


@transaction.atomic
def reset_password(actor: Actor, user: User) -> str:
    """Give another person a new, generated password; returns it, to be shown this once.

    Generated rather than typed by the admin: a password an admin invents tends to be short, reused or
    guessable, and then is known to two people for as long as it lasts; a generated one always passes the
    validators, is shown once (like a token's key, or the first admin's password of ``flotilla up``), and the
    person replaces it with one of their own (``change_password``, which asks for this one). The person's
    sessions end with the old password (Django checks each session against the password's hash), and so do
    their dashboard websockets at their next check; their tokens are untouched.

    Raises Forbidden when the admin asks it for themself: they change their own password with the old one,
    so that a stolen session cannot take over the account without knowing it.
    """
    if actor.user_id is not None and actor.user_id == user.pk:
        raise Forbidden("you cannot reset your own password: change it with your current one")
    password = generate_password()
    user.set_password(password)
    user.save(update_fields=["password"])
    record(actor, "user.password", user, before=None, after={"password": "reset"})
    return password


def change_password(actor: Actor, user: User, old_password: str, new_password: str, *, address: str = "") -> User:
    """A person's change of their own password: ``old_password`` must be their current one, and
    ``new_password`` pass the validators. Their other sessions end (the caller keeps its own with
    ``update_session_auth_hash``). Returns the person.

    Wrong old passwords count as failed logins of the person from ``address`` (controlplane/accounts/throttle.py),
    so a stolen token or session cannot guess the password faster than the login page allows.

    Raises Invalid naming ``old_password`` (wrong, or too many wrong tries: the message says how long to wait)
    or ``new_password`` (refused by the validators).
    """
    # Outside the transaction: a failure is counted even though the change is refused (and rolled back).
    wait = throttle.wait_s(user.get_username(), address)
    if wait:
        raise Invalid(f"too many wrong passwords: try again in {wait} s", field="old_password")
    if not user.has_usable_password() or not user.check_password(old_password):
        throttle.failed(user.get_username(), address)
        raise Invalid("this is not your current password", field="old_password")
    with transaction.atomic():
        _check_password(new_password, user, field="new_password")
        user.set_password(new_password)
        user.save(update_fields=["password"])
        record(actor, "user.password", user, before=None, after={"password": "changed"})
    return user


@transaction.atomic
def set_role(actor: Actor, user: User, role: Role) -> User:
    """Change a person's role. Raises Conflict when that demotes the last active admin."""
    user = _locked(user)
    before = snapshot(user, exclude=_USER_AUDIT_EXCLUDE)
    was_admin = _is_active_admin(user)
    user.role = role
    user.is_staff = role == Role.ADMIN or user.is_superuser
    if was_admin and not _is_active_admin(user):
        _keep_an_admin(actor, user, "demoting")
    user.save(update_fields=["role", "is_staff"])
    record(actor, "user.role", user, before=before, after=snapshot(user, exclude=_USER_AUDIT_EXCLUDE))
    return user


@transaction.atomic
def save_user(actor: Actor, user: User) -> User:
    """Save a person edited in the admin (a new one, or changes to an existing one's fields), with its
    audit entry. ``is_staff`` follows the role (the admin site is for admins), whatever the form said.

    Raises Conflict when the change would leave no active admin."""
    old = _locked(user) if user.pk and User.objects.filter(pk=user.pk).exists() else None
    before = snapshot(old, exclude=_USER_AUDIT_EXCLUDE) if old is not None else None
    user.is_staff = Role(user.role) == Role.ADMIN or user.is_superuser
    if old is not None and _is_active_admin(old) and not _is_active_admin(user):
        _keep_an_admin(actor, old, "demoting or deactivating")
    user.save()
    after = snapshot(user, exclude=_USER_AUDIT_EXCLUDE)
    if old is not None and user.password != old.password:
        after["password"] = "changed"
    record(actor, "user.create" if old is None else "user.update", user, before=before, after=after)
    if old is not None and old.is_active != user.is_active:
        follow_owner(actor, user)  # their API keys suspended or restored, as by deactivate_user/reactivate_user
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
    """Delete a person and their tokens (their audit entries stay, with their name). Raises Conflict for the
    last active admin."""
    if _is_active_admin(_locked(user)):
        _keep_an_admin(actor, user, "deleting")
    record(actor, "user.delete", user, before=snapshot(user, exclude=_USER_AUDIT_EXCLUDE), after=None)
    user.delete()


def _check_password(password: str, user: User, *, field: str = "password") -> None:
    try:
        validate_password(password, user)
    except ValidationError as exc:
        raise Invalid(" ".join(exc.messages), field=field) from exc


def _locked(user: User) -> User:
    """The person's row as it is now, locked until the transaction ends, after the active admins' rows.

    Every action that may demote or deactivate someone locks the admins first, in id order, then its person:
    two admins demoting each other at once take turns (rather than deadlock), and the second one finds the
    first change made, and itself the last admin. "No key" locks: audit entries naming a locked person as their
    actor (a foreign key) need not wait for them."""
    list(User.objects.select_for_update(no_key=True).filter(_ACTIVE_ADMINS).order_by("pk").values_list("pk", flat=True))
    return User.objects.select_for_update(no_key=True).get(pk=user.pk)


def _is_active_admin(user: User) -> bool:
    return user.is_active and user.effective_role == Role.ADMIN


def is_last_active_admin(user: User) -> bool:
    """Whether ``user`` is an active admin and no one else is (forms ask before the action decides)."""
    return _is_active_admin(user) and not User.objects.filter(_ACTIVE_ADMINS).exclude(pk=user.pk).exists()


def _keep_an_admin(actor: Actor, user: User, doing: str) -> None:
    """Raise Conflict when no one but ``user`` is an active admin (call it with the rows locked by ``_locked``)."""
    if not User.objects.filter(_ACTIVE_ADMINS).exclude(pk=user.pk).exists():
        who = "you are" if actor.user_id == user.pk else f"{user.username} is"
        raise Conflict(
            f"{who} the only active admin: {doing} would leave no one to manage people and tokens; "
            "make another person an admin first"
        )


def _set_active(actor: Actor, user: User, *, active: bool) -> User:
    before = snapshot(user, exclude=_USER_AUDIT_EXCLUDE)
    user.is_active = active
    user.save(update_fields=["is_active"])
    action = "user.reactivate" if active else "user.deactivate"
    record(actor, action, user, before=before, after=snapshot(user, exclude=_USER_AUDIT_EXCLUDE))
    follow_owner(actor, user)
    return user


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
