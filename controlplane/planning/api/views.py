from typing import ClassVar

from django.db.models import QuerySet
from django.shortcuts import get_object_or_404
from rest_framework import mixins

from controlplane.api.base import FlotillaViewSet
from controlplane.deployments.models import Pipeline
from controlplane.planning.api.serializers import PlannerDecisionSerializer
from controlplane.planning.models import PlannerDecision


class PlannerDecisionViewSet(mixins.ListModelMixin, FlotillaViewSet):
    """``/api/v1/pipelines/{id}/planner/decisions/``: the planner's decisions for the pipeline, latest first
    (a bounded history: docs/planner.md)."""

    serializer_class = PlannerDecisionSerializer
    queryset = PlannerDecision.objects.none()  # the schema's; get_queryset gives the pipeline's
    filter_backends: ClassVar = []  # the list is the pipeline's, newest first

    def get_queryset(self) -> QuerySet[PlannerDecision]:
        pipeline = get_object_or_404(Pipeline, pk=self.kwargs["pipeline_pk"])
        return PlannerDecision.objects.filter(pipeline=pipeline).order_by("-at", "-id")
