from typing import Any, ClassVar

from rest_framework import serializers

from controlplane.alerts.models import Alert, Rule, Silence
from controlplane.alerts.notify import silenced_by


class AlertSerializer(serializers.ModelSerializer):
    """An alert; ``silenced_by`` is the id of the silence that keeps it from being notified (null: none).
    The view passes the silences in force as ``silences`` in the context."""

    firing = serializers.BooleanField(read_only=True)
    silenced_by = serializers.SerializerMethodField()

    class Meta:
        model = Alert
        fields: ClassVar = [
            "id",
            "rule",
            "subject_type",
            "subject_id",
            "subject_name",
            "severity",
            "message",
            "fingerprint",
            "firing",
            "first_seen_at",
            "last_seen_at",
            "resolved_at",
            "silenced_by",
        ]
        read_only_fields = fields

    def get_silenced_by(self, alert: Alert) -> int | None:
        silence = silenced_by(alert, self.context.get("silences", []))
        return None if silence is None else silence.pk


class SilenceSerializer(serializers.ModelSerializer):
    """A silence. POST takes ``rule`` and/or ``subject``, ``ends_at`` (or ``duration_s``) and ``comment``."""

    active = serializers.SerializerMethodField()

    class Meta:
        model = Silence
        fields: ClassVar = ["id", "rule", "subject", "ends_at", "comment", "created_by_name", "created_at", "active"]
        read_only_fields = fields

    def get_active(self, silence: Silence) -> bool:
        return bool(silence.ends_at > self.context["now"])


class SilenceCreateSerializer(serializers.Serializer):
    rule = serializers.ChoiceField(choices=[("", "any"), *Rule.choices], required=False, default="")
    subject = serializers.CharField(
        max_length=255, required=False, default="", allow_blank=True, help_text="An alert's subject_name."
    )
    ends_at = serializers.DateTimeField(required=False, help_text="When it ends; or give duration_s.")
    duration_s = serializers.IntegerField(min_value=60, required=False, help_text="Seconds from now it lasts.")
    comment = serializers.CharField(max_length=2000, help_text="Why: so that others know.")

    def validate(self, data: dict[str, Any]) -> dict[str, Any]:
        if ("ends_at" in data) == ("duration_s" in data):
            raise serializers.ValidationError({"ends_at": ["Give ends_at or duration_s (one of them)."]})
        return data
