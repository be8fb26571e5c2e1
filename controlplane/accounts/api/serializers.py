from typing import Any, ClassVar

from django.contrib.auth.validators import UnicodeUsernameValidator
from rest_framework import serializers

from controlplane.accounts.models import ApiToken, Role, User
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


class PersonSerializer(serializers.ModelSerializer):
    """A person as admins see them (and as each person sees themself at /me/)."""

    has_password = serializers.SerializerMethodField(help_text="Whether they can log in (false: tokens only).")

    class Meta:
        model = User
        fields: ClassVar = [
            "id", "username", "first_name", "last_name", "email", "role", "is_active", "is_superuser", "has_password",
            "last_login", "date_joined",
        ]  # fmt: skip
        read_only_fields = fields

    def get_has_password(self, user: User) -> bool:
        return user.has_usable_password()


class PersonCreateSerializer(serializers.Serializer):
    """A new person; unless ``can_log_in`` is false, the answer carries their generated password, once."""

    username = serializers.CharField(max_length=150, validators=[UnicodeUsernameValidator()])
    role = serializers.ChoiceField(choices=Role.choices, default=Role.READ_ONLY)
    email = serializers.EmailField(allow_blank=True, default="")
    first_name = serializers.CharField(max_length=150, allow_blank=True, default="")
    last_name = serializers.CharField(max_length=150, allow_blank=True, default="")
    can_log_in = serializers.BooleanField(
        default=True,
        help_text="False: no password, the person uses tokens only (a password reset gives them one later).",
    )

    def validate_username(self, value: str) -> str:
        if User.objects.filter(username=value).exists():
            raise serializers.ValidationError(f"A person named {value!r} exists already.")
        return value


class PersonUpdateSerializer(serializers.Serializer):
    """What an admin may change of a person (what is left out stays as it is)."""

    role = serializers.ChoiceField(choices=Role.choices, required=False)
    email = serializers.EmailField(allow_blank=True, required=False)
    first_name = serializers.CharField(max_length=150, allow_blank=True, required=False)
    last_name = serializers.CharField(max_length=150, allow_blank=True, required=False)


class CreatedPersonSerializer(PersonSerializer):
    password = serializers.CharField(
        read_only=True, allow_null=True, help_text="The generated password: shown this once (null: tokens only)."
    )

    class Meta(PersonSerializer.Meta):
        fields: ClassVar = [*PersonSerializer.Meta.fields, "password"]
        read_only_fields = fields


class PasswordResetSerializer(serializers.Serializer):
    password = serializers.CharField(read_only=True, help_text="The new, generated password: shown this once.")


class PasswordChangeSerializer(serializers.Serializer):
    old_password = serializers.CharField(max_length=4096, trim_whitespace=False, style={"input_type": "password"})
    new_password = serializers.CharField(
        max_length=4096,
        trim_whitespace=False,
        style={"input_type": "password"},
        help_text="Checked by the password validators (FLOTILLA_PASSWORD_MIN_LENGTH and Django's others).",
    )
