from typing import ClassVar

from rest_framework import serializers

from controlplane.audit.models import AuditEntry


class AuditEntrySerializer(serializers.ModelSerializer):
    class Meta:
        model = AuditEntry
        fields: ClassVar = [
            "id",
            "created_at",
            "actor_name",
            "action",
            "target_type",
            "target_id",
            "target_name",
            "before",
            "after",
        ]
        read_only_fields = fields
