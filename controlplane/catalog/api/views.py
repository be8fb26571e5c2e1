from typing import Any, ClassVar

from rest_framework import mixins

from controlplane.api.base import FlotillaViewSet
from controlplane.catalog import actions
from controlplane.catalog.api.filters import ModelFilter
from controlplane.catalog.api.serializers import ModelSerializer
from controlplane.catalog.models import LanguageModel


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
