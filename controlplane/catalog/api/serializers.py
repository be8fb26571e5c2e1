from typing import ClassVar

from rest_framework import serializers

from controlplane.api.fields import JsonObjectField
from controlplane.catalog.models import LanguageModel

MAX_BYTES = 2**53  # a petabyte-scale ceiling that JSON numbers still hold exactly


class ModelSerializer(serializers.ModelSerializer):
    default_engine_args = JsonObjectField(required=False)
    size_bytes = serializers.IntegerField(min_value=0, max_value=MAX_BYTES, allow_null=True, required=False)
    memory_bytes = serializers.IntegerField(min_value=0, max_value=MAX_BYTES, allow_null=True, required=False)
    source_display = serializers.CharField(read_only=True)

    class Meta:
        model = LanguageModel
        fields: ClassVar = [
            "id",
            "name",
            "source_kind",
            "source",
            "revision",
            "filename",
            "source_display",
            "engine",
            "default_engine_args",
            "size_bytes",
            "memory_bytes",
            "created_at",
            "updated_at",
        ]
        read_only_fields: ClassVar = ["id", "created_at", "updated_at"]
