from typing import Any, ClassVar

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.accounts import actions
from controlplane.accounts.api.serializers import CreatedTokenSerializer, TokenCreateSerializer, TokenSerializer
from controlplane.accounts.models import ApiToken, Role
from controlplane.api.base import FlotillaViewSet


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
