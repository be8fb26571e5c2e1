from django.contrib import admin

from controlplane.audit.models import AuditEntry
from controlplane.readonly_admin import ReadOnlyAdmin


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnlyAdmin):
    list_display = ("created_at", "actor_name", "action", "target_type", "target_id", "target_name")
    list_filter = ("action", "target_type")
    search_fields = ("actor_name", "target_name", "target_id")
