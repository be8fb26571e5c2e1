from typing import ClassVar

import django_filters

from controlplane.audit.models import AuditEntry


class AuditEntryFilter(django_filters.FilterSet):
    since = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="gte")
    until = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="lt")
    action_prefix = django_filters.CharFilter(field_name="action", lookup_expr="startswith")

    class Meta:
        model = AuditEntry
        fields: ClassVar = ["actor_name", "action", "target_type", "target_id"]
