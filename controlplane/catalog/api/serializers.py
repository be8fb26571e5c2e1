from typing import ClassVar

from rest_framework import serializers

from controlplane.api.fields import JsonObjectField
from controlplane.catalog.models import Adapter, LanguageModel
from runtime.lora import MAX_NAME_LENGTH as MAX_ADAPTER_NAME_LENGTH

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
    projector = serializers.CharField(
        max_length=1024,
        required=False,
        allow_blank=True,
        help_text="out=llamacpp: the multimodal projector GGUF (mmproj) that lets the model take images: a file of "
        "the same Hugging Face repo, or for a local source an absolute path on the nodes",
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
            "projector",
            "source_display",
            "engine",
            "default_engine_args",
            "size_bytes",
            "projector_bytes",
            "memory_bytes",
            "memory_estimated",
            "context_length",
            "config",
            "created_at",
            "updated_at",
        ]
        read_only_fields: ClassVar = ["id", "projector_bytes", "memory_estimated", "created_at", "updated_at"]
        extra_kwargs: ClassVar = {
            "projector_bytes": {
                "help_text": "The projector's size on disk, counted in the estimate: read from a local file, or "
                "reported by the first node that fetched it (null: no projector, or not known yet)"
            }
        }


class AdapterSerializer(serializers.ModelSerializer):
    """A LoRA adapter of a model (catalog/adapters.py checks the name and the source)."""

    name = serializers.CharField(max_length=MAX_ADAPTER_NAME_LENGTH, help_text="The model name it is served as")
    source_kind = serializers.ChoiceField(
        choices=[LanguageModel.SourceKind.HUGGING_FACE, LanguageModel.SourceKind.FOLDER, LanguageModel.SourceKind.GGUF]
    )
    source_display = serializers.CharField(read_only=True)
    pipelines = serializers.SlugRelatedField(
        many=True, read_only=True, slug_field="name", help_text="The pipelines it is loaded on"
    )

    class Meta:
        model = Adapter
        fields: ClassVar = [
            "id",
            "name",
            "source_kind",
            "source",
            "revision",
            "filename",
            "source_display",
            "pipelines",
            "created_at",
        ]
        read_only_fields: ClassVar = ["id", "created_at"]
        # The name's uniqueness (letter case aside, and against the pipelines' names) is the action's check.
        validators: ClassVar = []
