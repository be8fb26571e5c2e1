from typing import Any, ClassVar

from django.contrib.auth import update_session_auth_hash
from django.db.models import QuerySet
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import mixins, status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.accounts import actions, throttle
from controlplane.accounts.api.serializers import (
    CreatedPersonSerializer,
    CreatedTokenSerializer,
    PasswordChangeSerializer,
    PasswordResetSerializer,
    PersonCreateSerializer,
    PersonSerializer,
    PersonUpdateSerializer,
    TokenCreateSerializer,
    TokenSerializer,
)
from controlplane.accounts.models import ApiToken, Role, User
from controlplane.api.base import FlotillaViewSet

_LAST_ADMIN = OpenApiResponse(description="the change would leave no active admin (or the person is so already)")


class TokenViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.DestroyModelMixin, FlotillaViewSet):
    """API tokens of people and agents (admin only). A new token's key is in the creation response only.

    A new agent token may revoke its node's older ones (``revoke_old``); any token may expire
    (``expires_at``); a person's may be read-only (``scope``: "read").
    """

    queryset = ApiToken.objects.select_related("user")
    serializer_class = TokenSerializer
    read_role: ClassVar = Role.ADMIN
    write_role: ClassVar = Role.ADMIN
    filterset_fields: ClassVar = ["kind", "node_name"]
    ordering_fields: ClassVar = ["created_at", "last_used_at"]

    @extend_schema(request=TokenCreateSerializer, responses={201: CreatedTokenSerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        serializer = TokenCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        if data["kind"] == ApiToken.Kind.PERSON:
            token, key = actions.create_person_token(
                self.actor, data["user"], data["description"], scope=data["scope"], expires_at=data["expires_at"]
            )
        else:
            token, key = actions.create_agent_token(
                self.actor,
                data["node_name"],
                data["description"],
                expires_at=data["expires_at"],
                revoke_old=data["revoke_old"],
            )
        token.key = key  # shown once, never stored
        return Response(CreatedTokenSerializer(token).data, status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance: ApiToken) -> None:
        actions.revoke_token(self.actor, instance)


class PersonViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, FlotillaViewSet):
    """People and their roles (admin only). A person is deactivated rather than deleted: their audit entries
    keep their name, and a deactivated person's logins, sessions, tokens, websockets and API keys are refused.

    A new person's password, and one an admin resets, is generated and shown once in the answer
    (``actions.reset_password`` says why); the person changes it at ``/me/password/``. Nothing leaves the
    fleet without an active admin: such a deactivation or demotion is a 409.
    """

    queryset = User.objects.order_by("username")
    serializer_class = PersonSerializer
    read_role: ClassVar = Role.ADMIN
    write_role: ClassVar = Role.ADMIN
    filterset_fields: ClassVar = ["role", "is_active"]
    ordering_fields: ClassVar = ["username", "last_login", "date_joined"]

    @extend_schema(request=PersonCreateSerializer, responses={201: CreatedPersonSerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        serializer = PersonCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = dict(serializer.validated_data)
        password = actions.generate_password() if data.pop("can_log_in") else None
        person = actions.create_user(
            self.actor, data.pop("username"), Role(data.pop("role")), password=password, **data
        )
        # Shown once: the row keeps only its hash.
        return Response({**PersonSerializer(person).data, "password": password}, status=status.HTTP_201_CREATED)

    @extend_schema(request=PersonUpdateSerializer, responses={200: PersonSerializer, 409: _LAST_ADMIN})
    def partial_update(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """Change a person's role, email or names."""
        serializer = PersonUpdateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        changes = dict(serializer.validated_data)
        if "role" in changes:
            changes["role"] = Role(changes["role"])
        person = actions.update_user(self.actor, self.get_object(), **changes)
        return Response(PersonSerializer(person).data)

    @extend_schema(request=None, responses={200: PersonSerializer, 409: _LAST_ADMIN})
    @action(detail=True, methods=["post"])
    def deactivate(self, request: Request, pk: str) -> Response:
        """Refuse the person's logins, sessions, tokens, websockets and API keys from now on (their tokens are
        kept; their API keys are suspended)."""
        return Response(PersonSerializer(actions.deactivate_user(self.actor, self.get_object())).data)

    @extend_schema(request=None, responses={200: PersonSerializer, 409: _LAST_ADMIN})
    @action(detail=True, methods=["post"])
    def reactivate(self, request: Request, pk: str) -> Response:
        """Let a deactivated person in again, with the role, password, tokens and API keys they had."""
        return Response(PersonSerializer(actions.reactivate_user(self.actor, self.get_object())).data)

    @extend_schema(
        request=None,
        responses={200: PasswordResetSerializer, 403: OpenApiResponse(description="not an admin, or one's own")},
    )
    @action(detail=True, methods=["post"], url_path="reset-password")
    def reset_password(self, request: Request, pk: str) -> Response:
        """Give the person a new generated password, shown in this answer only; their sessions end. One's own
        password is changed at /me/password/ with the current one."""
        password = actions.reset_password(self.actor, self.get_object())
        return Response(PasswordResetSerializer({"password": password}).data)


class MeViewSet(FlotillaViewSet):
    """The person the token (or session) is, whatever their role: who they are, and their password."""

    serializer_class = PersonSerializer
    write_role: ClassVar = Role.READ_ONLY

    def retrieve(self, request: Request) -> Response:
        return Response(PersonSerializer(request.user).data)

    @extend_schema(request=PasswordChangeSerializer, responses={204: None})
    def change_password(self, request: Request) -> Response:
        """Change one's own password, giving the current one. Wrong ones count as failed logins (throttled
        as the login page is); the person's other sessions end."""
        serializer = PasswordChangeSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        person = request.user
        assert isinstance(person, User)  # RolePermission admits people only
        actions.change_password(
            self.actor,
            person,
            serializer.validated_data["old_password"],
            serializer.validated_data["new_password"],
            address=throttle.client_address(request._request),
        )
        update_session_auth_hash(request._request, person)  # a browser's own session stays
        return Response(status=status.HTTP_204_NO_CONTENT)


class OwnTokenViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.DestroyModelMixin, FlotillaViewSet):
    """The caller's own tokens, whatever their role: listed and revoked (another person's token is a 404)."""

    serializer_class = TokenSerializer
    write_role: ClassVar = Role.READ_ONLY
    ordering_fields: ClassVar = ["created_at", "last_used_at"]

    def get_queryset(self) -> QuerySet[ApiToken]:
        if getattr(self, "swagger_fake_view", False):  # the schema is made without a person
            return ApiToken.objects.none()
        return ApiToken.objects.select_related("user").filter(kind=ApiToken.Kind.PERSON, user=self.request.user)

    def perform_destroy(self, instance: ApiToken) -> None:
        actions.revoke_token(self.actor, instance)
