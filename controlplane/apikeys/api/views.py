from typing import Any, ClassVar

from django.db.models import QuerySet
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import mixins, status
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.accounts.models import Role, User
from controlplane.api.base import FlotillaViewSet
from controlplane.apikeys import actions
from controlplane.apikeys.api.serializers import ApiKeyCreateSerializer, ApiKeySerializer, CreatedApiKeySerializer
from controlplane.apikeys.models import ApiKey


class ApiKeyViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, FlotillaViewSet):
    """Keys for the OpenAI endpoint (``Authorization: Bearer sk-flt-…`` on every ingress).

    Operators create and revoke their own; admins see and revoke everyone's, and may create one for
    someone else (``owner``). A new key's secret is in the creation response only.
    """

    serializer_class = ApiKeySerializer
    read_role: ClassVar = Role.OPERATOR
    write_role: ClassVar = Role.OPERATOR
    filterset_fields: ClassVar = ["name"]
    ordering_fields: ClassVar = ["created_at", "name"]

    def get_queryset(self) -> QuerySet[ApiKey]:
        if getattr(self, "swagger_fake_view", False):  # the schema generator's call: no person
            return ApiKey.objects.none()
        return ApiKey.visible_to(self.request.user)

    @extend_schema(
        request=ApiKeyCreateSerializer,
        responses={201: CreatedApiKeySerializer, 403: OpenApiResponse(description="owner given by a non-admin")},
    )
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        serializer = ApiKeyCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        user = request.user
        assert isinstance(user, User)  # RolePermission let only people through
        owner = serializer.validated_data["owner"] or user
        if owner != user and not user.has_role(Role.ADMIN):
            raise PermissionDenied("only an admin may create a key for someone else")
        key, secret = actions.create_key(
            self.actor, owner, serializer.validated_data["name"], **serializer.validated_options()
        )
        key.key = secret  # shown once, never stored
        return Response(CreatedApiKeySerializer(key).data, status=status.HTTP_201_CREATED)

    @extend_schema(
        request=None,
        responses={200: ApiKeySerializer, 409: OpenApiResponse(description="the key was revoked already")},
    )
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str) -> Response:
        """Revoke the key: every ingress refuses it within a second (as soon as its etcd watch hears)."""
        key = actions.revoke_key(self.actor, self.get_object())
        return Response(ApiKeySerializer(key).data)
