from typing import Any, ClassVar

from rest_framework import serializers

from controlplane.accounts.models import ApiToken, User
from controlplane.fleet.models import NODE_NAME_PATTERN


class TokenSerializer(serializers.ModelSerializer):
    user = serializers.SlugRelatedField(slug_field="username", read_only=True)

    class Meta:
        model = ApiToken
        fields: ClassVar = [
            "id", "kind", "user", "node_name", "description", "scope", "key_start", "created_at", "expires_at",
            "last_used_at",
        ]  # fmt: skip
        read_only_fields = fields


class TokenCreateSerializer(serializers.Serializer):
    """A person's token (``username``) or a node agent's (``node_name``)."""

    kind = serializers.ChoiceField(choices=ApiToken.Kind.choices)
    username = serializers.SlugRelatedField(
        slug_field="username", queryset=User.objects.all(), required=False, source="user"
    )
    node_name = serializers.RegexField(NODE_NAME_PATTERN, max_length=63, required=False)
    description = serializers.CharField(max_length=200, allow_blank=True, default="")
    scope = serializers.ChoiceField(
        choices=ApiToken.Scope.choices,
        default=ApiToken.Scope.FULL,
        help_text="A person's token: 'read' lets it only read (GET), whatever the person's role.",
    )
    expires_at = serializers.DateTimeField(
        required=False, allow_null=True, default=None, help_text="When the token stops working (none: never)."
    )
    revoke_old = serializers.BooleanField(
        default=False,
        help_text="An agent's token: revoke the node's other agent tokens now (their agent is refused from then on).",
    )

    def validate(self, data: dict[str, Any]) -> dict[str, Any]:
        if data["kind"] == ApiToken.Kind.PERSON:
            if "user" not in data:
                raise serializers.ValidationError({"username": ["A person's token needs a username."]})
            if "node_name" in data:
                raise serializers.ValidationError({"node_name": ["Only an agent's token names a node."]})
            if data["revoke_old"]:
                raise serializers.ValidationError({"revoke_old": ["Only an agent's token revokes older ones."]})
        else:
            if "node_name" not in data:
                raise serializers.ValidationError({"node_name": ["An agent's token needs the node's name."]})
            if "user" in data:
                raise serializers.ValidationError({"username": ["An agent's token has no user."]})
            if data["scope"] != ApiToken.Scope.FULL:
                raise serializers.ValidationError(
                    {"scope": ["An agent's token cannot be scoped: its endpoints write."]}
                )
        return data


class CreatedTokenSerializer(TokenSerializer):
    key = serializers.CharField(read_only=True, help_text="The token itself: shown this once, never again.")

    class Meta(TokenSerializer.Meta):
        fields: ClassVar = [*TokenSerializer.Meta.fields, "key"]
        read_only_fields = fields
