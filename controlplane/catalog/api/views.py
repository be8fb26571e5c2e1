from typing import Any, ClassVar

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import mixins, serializers, status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.api.base import FlotillaViewSet
from controlplane.catalog import actions, adapters
from controlplane.catalog.api.filters import ModelFilter
from controlplane.catalog.api.serializers import AdapterSerializer, ModelSerializer
from controlplane.catalog.models import Adapter, LanguageModel

_PROFILE = serializers.JSONField(help_text="A profile document (docs/planner.md)")


class ModelViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.UpdateModelMixin,
    mixins.DestroyModelMixin,
    FlotillaViewSet,
):
    """The model catalog: read with read-only, change with operator."""

    queryset = LanguageModel.objects.all()
    serializer_class = ModelSerializer
    filterset_class = ModelFilter
    ordering_fields: ClassVar = ["name", "created_at", "size_bytes", "memory_bytes"]

    def perform_create(self, serializer: Any) -> None:
        serializer.instance = actions.create_model(self.actor, **serializer.validated_data)

    def perform_update(self, serializer: Any) -> None:
        serializer.instance = actions.update_model(self.actor, serializer.instance, **serializer.validated_data)

    def perform_destroy(self, instance: LanguageModel) -> None:
        actions.delete_model(self.actor, instance)

    # PUT is this viewset's for the profile only (a profile is replaced whole); the model itself is PATCHed.
    http_method_names: ClassVar[list[str]] = [*FlotillaViewSet.http_method_names, "put"]

    @extend_schema(exclude=True)
    def update(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        if not kwargs.get("partial"):
            self.http_method_not_allowed(request)
        return super().update(request, *args, **kwargs)

    @extend_schema(
        methods=["GET"],
        responses={200: _PROFILE, 404: OpenApiResponse(description="no such model, or it has no profile")},
    )
    @extend_schema(
        methods=["PUT"],
        request=_PROFILE,
        responses={200: _PROFILE, 400: OpenApiResponse(description="each problem under its path in the profile")},
    )
    @extend_schema(methods=["DELETE"], request=None, responses={204: None})
    @action(detail=True, methods=["get", "put", "delete"])
    def profile(self, request: Request, pk: str) -> Response:
        """The model's profile (docs/planner.md, "A profile"): its capacity at latency targets, which the
        planner's SLA mode sizes groups with. PUT replaces it with the body, DELETE removes it (load mode)."""
        model = self.get_object()
        if request.method == "GET":
            if model.profile is None:
                return Response({"detail": f"model {model.name} has no profile"}, status=status.HTTP_404_NOT_FOUND)
            return Response(model.profile)
        if request.method == "DELETE":
            actions.set_profile(self.actor, model, None)
            return Response(status=status.HTTP_204_NO_CONTENT)
        model = actions.set_profile(self.actor, model, request.data)
        return Response(model.profile)

    @extend_schema(methods=["GET"], responses=AdapterSerializer(many=True))
    @extend_schema(
        methods=["POST"],
        request=AdapterSerializer,
        responses={201: AdapterSerializer, 400: OpenApiResponse(description="a bad name or source; a name served")},
    )
    @action(detail=True, methods=["get", "post"], url_path="adapters")
    def adapters(self, request: Request, pk: str) -> Response:
        """The model's LoRA adapters (docs/controlplane.md, "LoRA adapters"); POST adds one: its served name and
        its source (a Hugging Face repo, or a folder or GGUF file on the nodes)."""
        model = self.get_object()
        if request.method == "GET":
            rows = model.adapters.prefetch_related("pipelines")
            return Response(AdapterSerializer(rows, many=True).data)
        serializer = AdapterSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        adapter = adapters.create_adapter(self.actor, model, **serializer.validated_data)
        return Response(AdapterSerializer(adapter).data, status=status.HTTP_201_CREATED)

    @extend_schema(
        request=None, responses={204: None, 404: OpenApiResponse(description="no such adapter of this model")}
    )
    @action(detail=True, methods=["delete"], url_path=r"adapters/(?P<adapter>[^?#]+?)")
    def delete_adapter(self, request: Request, pk: str, adapter: str) -> Response:
        """Remove an adapter from the catalog (409 while a pipeline has it loaded)."""
        model = self.get_object()
        row = Adapter.objects.filter(model=model, name=adapter).first()
        if row is None:
            return Response(
                {"detail": f"model {model.name} has no adapter named {adapter!r}"}, status=status.HTTP_404_NOT_FOUND
            )
        adapters.delete_adapter(self.actor, row)
        return Response(status=status.HTTP_204_NO_CONTENT)
