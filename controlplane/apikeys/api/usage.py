"""``/api/v1/usage/``: what each key used, per model and UTC day, as rows or as CSV."""

import csv
import io
from typing import ClassVar

import django_filters
from django.db.models import QuerySet
from django.http import HttpResponse
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import mixins
from rest_framework.decorators import action
from rest_framework.request import Request

from controlplane.accounts.models import Role
from controlplane.api.base import FlotillaViewSet
from controlplane.apikeys.api.serializers import KeyUsageSerializer
from controlplane.apikeys.models import ApiKey, KeyUsage

CSV_FIELDS = KeyUsageSerializer.Meta.fields


class UsageFilter(django_filters.FilterSet):
    key = django_filters.NumberFilter(field_name="key_id", help_text="a key's id")
    model = django_filters.CharFilter(help_text="a served model's name")
    since = django_filters.DateFilter(field_name="day", lookup_expr="gte", help_text="from this day (UTC), YYYY-MM-DD")
    until = django_filters.DateFilter(field_name="day", lookup_expr="lte", help_text="to this day (UTC), YYYY-MM-DD")

    class Meta:
        model = KeyUsage
        fields: ClassVar = ["key", "model", "since", "until"]


class UsageViewSet(mixins.ListModelMixin, FlotillaViewSet):
    """Usage of the OpenAI endpoint per key, model and UTC day: your keys' (an admin's: every key's).

    Counted by the ingress processes and moved here every ``FLOTILLA_USAGE_DRAIN_S`` (10 s).
    """

    serializer_class = KeyUsageSerializer
    filterset_class = UsageFilter
    read_role: ClassVar = Role.OPERATOR
    ordering_fields: ClassVar = ["day", "requests", "prompt_tokens", "completion_tokens"]

    def get_queryset(self) -> QuerySet[KeyUsage]:
        rows = KeyUsage.objects.select_related("key__owner")
        if getattr(self, "swagger_fake_view", False):  # the schema generator's call: no person
            return rows.none()
        return rows.filter(key__in=ApiKey.visible_to(self.request.user))

    @extend_schema(responses={(200, "text/csv"): OpenApiResponse(description="the rows as CSV, with a header line")})
    @action(detail=False, methods=["get"])
    def export(self, request: Request) -> HttpResponse:
        """The same rows (and filters) as CSV, all of them, oldest day first."""
        rows = self.filter_queryset(self.get_queryset()).order_by("day", "key_id", "model")
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(CSV_FIELDS)
        for row in KeyUsageSerializer(rows, many=True).data:
            writer.writerow([row[field] for field in CSV_FIELDS])
        response = HttpResponse(out.getvalue(), content_type="text/csv; charset=utf-8")
        response["Content-Disposition"] = 'attachment; filename="flotilla-usage.csv"'
        return response
