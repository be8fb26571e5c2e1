from typing import ClassVar

from rest_framework import serializers

from controlplane.api.fields import JsonObjectField
from controlplane.catalog.models import LanguageModel

MAX_BYTES = 2**53  # a petabyte-scale ceiling that JSON numbers still hold exactly
MAX_CONTEXT = 1 << 24


class ModelSerializer(serializers.ModelSerializer):
    default_engine_args = JsonObjectField(required=False)
    size_bytes = serializers.IntegerField(min_value=0, max_value=MAX_BYTES, allow_null=True, required=False)
    memory_bytes = serializers.IntegerField(
        min_value=0,
        max_value=MAX_BYTES,
        allow_null=True,
        required=False,
        help_text="Memory one replica needs; leave it out (or null) for an estimate from size, config and context",
    )
    context_length = serializers.IntegerField(
        min_value=1, max_value=MAX_CONTEXT, allow_null=True, required=False, help_text="Tokens of context to plan for"
    )
    config = JsonObjectField(
        required=False, max_bytes=64 * 1024, help_text="The model's config.json (layers, heads...) for the estimate"
    )
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
            "memory_estimated",
            "context_length",
            "config",
            "created_at",
            "updated_at",
        ]
        read_only_fields: ClassVar = ["id", "memory_estimated", "created_at", "updated_at"]
