from typing import Any, ClassVar

from django.db.models import Count, Prefetch, Q, QuerySet
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import mixins, status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.api.base import FlotillaViewSet
from controlplane.deployments import adapters as adapter_actions
from controlplane.deployments import pipelines as pipeline_actions
from controlplane.deployments.api.filters import PipelineFilter
from controlplane.deployments.api.serializers import (
    AdapterLoadSerializer,
    GroupUpdateSerializer,
    PipelineAdaptersSerializer,
    PipelineSerializer,
    PipelineUpdateSerializer,
    ScaleSerializer,
)
from controlplane.deployments.instance_states import InstanceState
from controlplane.deployments.models import Pipeline, WorkerGroup


def _groups_with_state_counts() -> QuerySet[WorkerGroup]:
    counts = {f"n_{state}": Count("instances", filter=Q(instances__state=state)) for state in InstanceState.values}
    return WorkerGroup.objects.select_related("pipeline").annotate(**counts).order_by("role")


class PipelineViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.DestroyModelMixin,
    FlotillaViewSet,
):
    """Pipelines: POST deploys, PATCH changes router and placement; scale, stop and start are actions.
    All changes need operator. DELETE removes a stopped pipeline whose instances have stopped."""

    queryset = Pipeline.objects.select_related("model")
    serializer_class = PipelineSerializer
    filterset_class = PipelineFilter
    ordering_fields: ClassVar = ["name", "created_at", "updated_at"]

    def get_queryset(self) -> QuerySet[Pipeline]:
        return super().get_queryset().prefetch_related(Prefetch("groups", queryset=_groups_with_state_counts()))

    def perform_create(self, serializer: Any) -> None:
        serializer.instance = pipeline_actions.deploy_pipeline(self.actor, **serializer.deploy_arguments())

    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        self.perform_create(serializer)
        return Response(self._fresh(serializer.instance), status=status.HTTP_201_CREATED)

    @extend_schema(request=PipelineUpdateSerializer, responses=PipelineSerializer)
    def partial_update(self, request: Request, pk: str) -> Response:
        """Change router settings or placement (policy, pins). Placement changes leave running instances
        where they are; router settings roll out to the workers, one at a time."""
        pipeline = self.get_object()
        serializer = PipelineUpdateSerializer(data=request.data, partial=True, context={"pipeline": pipeline})
        serializer.is_valid(raise_exception=True)
        pipeline_actions.update_pipeline(self.actor, pipeline, **serializer.validated_data)
        return Response(self._fresh(pipeline))

    def perform_destroy(self, instance: Pipeline) -> None:
        pipeline_actions.delete_pipeline(self.actor, instance)

    @extend_schema(request=ScaleSerializer, responses=PipelineSerializer)
    @action(detail=True, methods=["post"])
    def scale(self, request: Request, pk: str) -> Response:
        """Set a worker group's replicas (``role`` picks the group when there are several)."""
        pipeline = self.get_object()
        serializer = ScaleSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        pipeline_actions.scale_pipeline(self.actor, pipeline, **serializer.validated_data)
        return Response(self._fresh(pipeline))

    @extend_schema(
        request=GroupUpdateSerializer,
        responses={
            200: PipelineSerializer,
            400: OpenApiResponse(description="a field the group cannot take"),
            409: OpenApiResponse(description="the group has these settings already"),
        },
    )
    @action(detail=True, methods=["post"], url_path="update-group")
    def update_group(self, request: Request, pk: str) -> Response:
        """Change a worker group's engine args or GPUs per replica: its instances are replaced one at a time,
        each replacement ready before the instance it replaces stops (``outdated`` counts those left)."""
        pipeline = self.get_object()
        serializer = GroupUpdateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        pipeline_actions.update_group(self.actor, pipeline, **serializer.validated_data)
        return Response(self._fresh(pipeline))

    @extend_schema(request=None, responses=PipelineSerializer)
    @action(detail=True, methods=["post"])
    def stop(self, request: Request, pk: str) -> Response:
        """Stop all instances; replica counts are kept for start."""
        pipeline = pipeline_actions.stop_pipeline(self.actor, self.get_object())
        return Response(self._fresh(pipeline))

    @extend_schema(request=None, responses=PipelineSerializer)
    @action(detail=True, methods=["post"])
    def start(self, request: Request, pk: str) -> Response:
        """Run a stopped pipeline again with its replica counts."""
        pipeline = pipeline_actions.start_pipeline(self.actor, self.get_object())
        return Response(self._fresh(pipeline))

    @extend_schema(methods=["GET"], responses=PipelineAdaptersSerializer)
    @extend_schema(
        methods=["POST"],
        request=AdapterLoadSerializer,
        responses={
            200: PipelineAdaptersSerializer,
            400: OpenApiResponse(description="not an adapter of its model, an engine without LoRA, too many"),
            409: OpenApiResponse(description="loaded already, here or on another pipeline"),
        },
    )
    @action(detail=True, methods=["get", "post"])
    def adapters(self, request: Request, pk: str) -> Response:
        """The LoRA adapters loaded on the pipeline; POST loads one of its model's (``{"adapter": name}``), at run
        time: its workers' agents download it and the workers load it, no restart (but for the first ever)."""
        pipeline = self.get_object()
        if request.method == "POST":
            serializer = AdapterLoadSerializer(data=request.data)
            serializer.is_valid(raise_exception=True)
            adapter_actions.load_adapter(self.actor, pipeline, serializer.validated_data["adapter"])
        return Response(PipelineAdaptersSerializer(Pipeline.objects.get(pk=pipeline.pk)).data)

    @extend_schema(
        request=None,
        responses={200: PipelineAdaptersSerializer, 400: OpenApiResponse(description="no such adapter loaded")},
    )
    @action(detail=True, methods=["delete"], url_path=r"adapters/(?P<adapter>[^?#]+?)")
    def unload_adapter(self, request: Request, pk: str, adapter: str) -> Response:
        """Unload an adapter from the pipeline: its workers stop serving it, without a restart."""
        pipeline = self.get_object()
        adapter_actions.unload_adapter(self.actor, pipeline, adapter)
        return Response(PipelineAdaptersSerializer(Pipeline.objects.get(pk=pipeline.pk)).data)

    def _fresh(self, pipeline: Pipeline) -> Any:
        """The pipeline as it is now, instance counts included (it was just changed)."""
        return self.get_serializer(self.get_queryset().get(pk=pipeline.pk)).data
