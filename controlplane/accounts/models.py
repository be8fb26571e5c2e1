"""People, their roles, and API tokens (for people and for node agents).

Roles are a field on the user rather than Django groups: a person has exactly one role, the roles are
ordered (each can do what the one below it can), and a field says so in one place that permissions,
the admin and the API all read. Superusers are admins whatever the field says.
"""

import hashlib
import secrets
from enum import StrEnum
from typing import ClassVar

from django.contrib.auth.models import AbstractUser
from django.db import models
from django.db.models import Q

TOKEN_PREFIX = "flt_"
# Shown in listings so that a person can tell tokens apart without the secret part.
TOKEN_DISPLAY_CHARS = 12


class Role(models.TextChoices):
    """What a person may do; each role includes the ones before it."""

    READ_ONLY = "read_only", "read-only"  # read models, nodes, pipelines, instances
    OPERATOR = "operator", "operator"  # + deploy, scale, stop, restart, drain; edit the catalog; read the audit log
    ADMIN = "admin", "admin"  # + delete nodes, manage people's and agents' tokens, trust a model's remote code

    @property
    def rank(self) -> int:
        return list(Role).index(self)


class Permission(StrEnum):
    """What a role allows beyond what its rank says: a power held by the roles ``ROLE_PERMISSIONS`` lists."""

    #: Turn on an engine's ``trust_remote_code`` (controlplane/catalog/remote_code.py): the model repo's own
    #: Python code then runs in the workers, on the nodes, which is an operator's code execution there.
    TRUST_REMOTE_CODE = "trust_remote_code"


ROLE_PERMISSIONS: dict[Role, frozenset[Permission]] = {
    Role.READ_ONLY: frozenset(),
    Role.OPERATOR: frozenset(),
    Role.ADMIN: frozenset({Permission.TRUST_REMOTE_CODE}),
}


class User(AbstractUser):
    """A person who uses the dashboard or the API."""

    role = models.CharField(max_length=16, choices=Role.choices, default=Role.READ_ONLY)

    @property
    def effective_role(self) -> Role:
        return Role.ADMIN if self.is_superuser else Role(self.role)

    def has_role(self, needed: Role) -> bool:
        """Whether this person's role is ``needed`` or above it (inactive people have none)."""
        return self.is_active and self.effective_role.rank >= needed.rank

    def held_permissions(self) -> frozenset[Permission]:
        """The permissions this person's role holds (inactive people hold none)."""
        return ROLE_PERMISSIONS[self.effective_role] if self.is_active else frozenset()


def hash_token(key: str) -> str:
    """The stored form of a token: its SHA-256 (tokens are random, so no salt or slow hash is needed)."""
    return hashlib.sha256(key.encode()).hexdigest()


class ApiToken(models.Model):
    """A bearer token: a person's (acting with that person's role) or a node agent's.

    An agent token names its node by name rather than by row, because the agent uses it to register the
    node in the first place; it may act only on that node (its registration, heartbeats, instances).
    The key itself is shown once at creation and stored only as a hash.

    A token may expire (``expires_at``), and a person's may be scoped to reading (``scope``): it then
    reads what its person's role may read, and changes nothing, whatever that role.
    """

    class Kind(models.TextChoices):
        PERSON = "person"
        AGENT = "agent"

    class Scope(models.TextChoices):
        """What a person's token may do: all its person's role allows, or only read (safe methods)."""

        FULL = "full", "what the role allows"
        READ = "read", "read only"

    kind = models.CharField(max_length=8, choices=Kind.choices)
    user = models.ForeignKey(User, null=True, blank=True, on_delete=models.CASCADE, related_name="api_tokens")
    node_name = models.CharField(max_length=63, blank=True, db_index=True)
    description = models.CharField(max_length=200, blank=True)
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    key_start = models.CharField(max_length=TOKEN_DISPLAY_CHARS, editable=False)
    scope = models.CharField(max_length=8, choices=Scope.choices, default=Scope.FULL)
    created_at = models.DateTimeField(auto_now_add=True)
    # Past it the token is refused (401, saying when it expired); None: it never expires.
    expires_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering: ClassVar = ["id"]
        constraints: ClassVar = [
            models.CheckConstraint(
                name="token_owner_matches_kind",
                condition=(Q(kind="person", user__isnull=False, node_name="") | Q(kind="agent", user__isnull=True))
                & ~Q(kind="agent", node_name=""),
            ),
            # An agent's token is for its node's agent endpoints, which all write: a read scope means nothing.
            models.CheckConstraint(name="agent_token_scope_full", condition=~Q(kind="agent", scope="read")),
        ]

    def __str__(self) -> str:
        owner = self.user.username if self.user else f"agent of {self.node_name}"
        return f"{self.key_start}… ({owner})"

    @staticmethod
    def new_key() -> str:
        return TOKEN_PREFIX + secrets.token_urlsafe(32)


class FailedLogin(models.Model):
    """One failed password login, kept for ``LOGIN_WINDOW_S`` to slow guessing (controlplane/accounts/throttle.py).

    In the database rather than a per-process cache, so that every uvicorn worker counts the same attempts.
    """

    username = models.CharField(max_length=150)
    address = models.CharField(max_length=64)
    at = models.DateTimeField()

    class Meta:
        indexes: ClassVar = [models.Index(fields=["username", "address", "at"], name="failed_login_key")]
