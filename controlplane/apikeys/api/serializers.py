from typing import Any, ClassVar

from rest_framework import serializers

from controlplane.accounts.models import User
from controlplane.apikeys.models import ApiKey, KeyUsage
from controlplane.deployments.models import SERVED_NAME_PATTERN

MAX_MODELS_PER_KEY = 100
MAX_LIMIT = 10**9
MAX_BUDGET = 10**15


class ApiKeySerializer(serializers.ModelSerializer):
    owner = serializers.SlugRelatedField(slug_field="username", read_only=True)
    revoked = serializers.BooleanField(read_only=True)
    suspended = serializers.BooleanField(
        read_only=True, help_text="Refused while its owner is deactivated; it works again when they are reactivated."
    )

    class Meta:
        model = ApiKey
        fields: ClassVar = [
            "id", "name", "owner", "key_start", "allowed_models", "expires_at", "requests_per_minute",
            "tokens_per_minute", "monthly_token_budget", "max_concurrent_requests", "revoked", "revoked_at",
            "suspended", "created_at",
        ]  # fmt: skip
        read_only_fields = fields


class ApiKeyCreateSerializer(serializers.Serializer):
    """A new key; ``owner`` (a username) only an admin may give, for a key of someone else's."""

    name = serializers.CharField(max_length=100, help_text="What the key is for, e.g. the application's name.")
    owner = serializers.SlugRelatedField(
        slug_field="username", queryset=User.objects.filter(is_active=True), required=False, default=None
    )
    allowed_models = serializers.ListField(
        child=serializers.RegexField(SERVED_NAME_PATTERN, max_length=200),
        max_length=MAX_MODELS_PER_KEY,
        default=list,
        help_text="Served model names the key may use; empty: every model.",
    )
    expires_at = serializers.DateTimeField(
        required=False, allow_null=True, default=None, help_text="When the key stops working (none: never)."
    )
    requests_per_minute = serializers.IntegerField(min_value=1, max_value=MAX_LIMIT, required=False, allow_null=True)
    tokens_per_minute = serializers.IntegerField(
        min_value=1, max_value=MAX_LIMIT, required=False, allow_null=True, help_text="Prompt and completion tokens."
    )
    monthly_token_budget = serializers.IntegerField(min_value=1, max_value=MAX_BUDGET, required=False, allow_null=True)
    max_concurrent_requests = serializers.IntegerField(
        min_value=1,
        max_value=MAX_LIMIT,
        required=False,
        allow_null=True,
        help_text="Requests served at once by each ingress process; none: the ingress's default, if any.",
    )

    def validate_name(self, value: str) -> str:
        if not value.strip():
            raise serializers.ValidationError("A key needs a name.")
        return value.strip()

    def validated_options(self) -> dict[str, Any]:
        data = dict(self.validated_data)
        data.pop("name")
        data.pop("owner")
        return data


class CreatedApiKeySerializer(ApiKeySerializer):
    key = serializers.CharField(read_only=True, help_text="The key itself: shown this once, never again.")

    class Meta(ApiKeySerializer.Meta):
        fields: ClassVar = [*ApiKeySerializer.Meta.fields, "key"]
        read_only_fields = fields


class KeyUsageSerializer(serializers.ModelSerializer):
    key_name = serializers.CharField(source="key.name", read_only=True)
    owner = serializers.CharField(source="key.owner.username", read_only=True)

    class Meta:
        model = KeyUsage
        fields: ClassVar = [
            "day", "key", "key_name", "owner", "model", "requests", "prompt_tokens", "cached_tokens",
            "completion_tokens", "errors",
        ]  # fmt: skip
        read_only_fields = fields
