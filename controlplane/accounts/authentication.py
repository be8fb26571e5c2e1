"""Token authentication for the API: ``Authorization: Bearer <key>`` (or ``Token <key>``).

A person's token authenticates as that person; an agent's token authenticates as an ``AgentPrincipal``
(not a user: agents have no role and may only use the agent endpoints of their own node). A token past
its ``expires_at`` is refused (401) saying when it expired; what a read-scoped token may do is the
permissions' to say (controlplane/api/permissions.py), from ``request.auth``.
"""

import logging
from dataclasses import dataclass
from datetime import UTC, timedelta

from django.db import DatabaseError, transaction
from django.db.models import BooleanField, ExpressionWrapper, Q
from django.db.models.functions import Now
from django.utils import timezone
from rest_framework import authentication, exceptions
from rest_framework.request import Request

from controlplane.accounts.models import ApiToken, User, hash_token

# Writing last_used_at on every request would turn each heartbeat into two writes; once a minute is enough
# to tell a forgotten token from a live one.
LAST_USED_RESOLUTION = timedelta(minutes=1)
_SCHEMES = (b"bearer", b"token")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentPrincipal:
    """Who a request with an agent token is: the agent of one node."""

    node_name: str
    token_id: int

    is_authenticated = True
    is_anonymous = False
    is_active = True

    @property
    def username(self) -> str:
        return f"agent:{self.node_name}"

    def __str__(self) -> str:
        return self.username


class TokenAuthentication(authentication.BaseAuthentication):
    """Looks the token's hash up; refuses unknown and expired tokens and tokens of inactive people with 401."""

    keyword = "Bearer"

    def authenticate(self, request: Request) -> tuple[User | AgentPrincipal, ApiToken] | None:
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].lower() not in _SCHEMES:
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("the Authorization header must be 'Bearer <token>'")
        try:
            key = header[1].decode("ascii")
        except UnicodeDecodeError as exc:
            raise exceptions.AuthenticationFailed("the token must be ASCII") from exc
        token = (
            ApiToken.objects.select_related("user")
            # Expiry is judged on the database's clock, the one every process compares timestamps with.
            .annotate(expired=ExpressionWrapper(Q(expires_at__lte=Now()), output_field=BooleanField()))
            .filter(key_hash=hash_token(key))
            .first()
        )
        if token is None:
            raise exceptions.AuthenticationFailed("unknown or revoked token")
        if token.expired:  # type: ignore[attr-defined]  # the annotation
            assert token.expires_at is not None
            expired_at = token.expires_at.astimezone(UTC)
            raise exceptions.AuthenticationFailed(
                f"this token expired at {expired_at:%Y-%m-%d %H:%M:%S} UTC: ask an admin for a new one"
            )
        self._touch(token)
        if token.kind == ApiToken.Kind.AGENT:
            return AgentPrincipal(node_name=token.node_name, token_id=token.pk), token
        assert token.user is not None  # the check constraint ties person tokens to a user
        if not token.user.is_active:
            raise exceptions.AuthenticationFailed("this token's user is inactive")
        return token.user, token

    def authenticate_header(self, request: Request) -> str:
        return self.keyword

    @staticmethod
    def _touch(token: ApiToken) -> None:
        """Record when the token was last used: bookkeeping, so a write that fails (a lock held by a
        concurrent request, say) is logged and the request is served all the same. The savepoint keeps a
        surrounding transaction usable after the failed write."""
        now = timezone.now()
        if token.last_used_at is None or now - token.last_used_at >= LAST_USED_RESOLUTION:
            try:
                with transaction.atomic():
                    ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
            except DatabaseError as exc:
                logger.warning("could not record that token %s was used (%s); the next request will", token.pk, exc)
                return
            token.last_used_at = now
