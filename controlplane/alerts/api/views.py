import datetime
from typing import Any, ClassVar

import django_filters
from django.db.models import QuerySet
from django.utils import timezone
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import mixins, status
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.accounts.models import Role
from controlplane.alerts import actions
from controlplane.alerts.api.serializers import AlertSerializer, SilenceCreateSerializer, SilenceSerializer
from controlplane.alerts.models import Alert, Silence
from controlplane.alerts.notify import active_silences
from controlplane.api.base import FlotillaViewSet


class AlertFilter(django_filters.FilterSet):
    firing = django_filters.BooleanFilter(field_name="resolved_at", lookup_expr="isnull", label="firing")

    class Meta:
        model = Alert
        fields: ClassVar = ["rule", "subject_type", "severity"]


class AlertViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, FlotillaViewSet):
    """Alerts, newest first: ``?firing=true`` for those firing now (read-only; everyone may read)."""

    queryset = Alert.objects.all()
    serializer_class = AlertSerializer
    filterset_class = AlertFilter
    ordering_fields: ClassVar = ["first_seen_at", "id"]

    def get_serializer_context(self) -> dict[str, Any]:
        return super().get_serializer_context() | {"silences": active_silences(timezone.now())}


class SilenceViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, FlotillaViewSet):
    """Silences: matching alerts (by rule and/or subject) are not notified until the silence ends. Operators
    and admins create them (POST) and expire them (DELETE ends one now; the row stays)."""

    serializer_class = SilenceSerializer
    write_role: ClassVar = Role.OPERATOR
    filterset_fields: ClassVar = ["rule", "subject"]

    def get_queryset(self) -> QuerySet[Silence]:
        return Silence.objects.all()

    def get_serializer_context(self) -> dict[str, Any]:
        return super().get_serializer_context() | {"now": timezone.now()}

    @extend_schema(request=SilenceCreateSerializer, responses={201: SilenceSerializer})
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        body = SilenceCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        now = timezone.now()
        ends_at = data.get("ends_at") or now + datetime.timedelta(seconds=data["duration_s"])
        silence = actions.create_silence(
            self.actor, rule=data["rule"], subject=data["subject"], ends_at=ends_at, comment=data["comment"], now=now
        )
        return Response(self.get_serializer(silence).data, status=status.HTTP_201_CREATED)

    @extend_schema(
        request=None,
        responses={200: SilenceSerializer, 409: OpenApiResponse(description="the silence has ended already")},
    )
    def destroy(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        silence = actions.expire_silence(self.actor, self.get_object())
        return Response(self.get_serializer(silence).data)
