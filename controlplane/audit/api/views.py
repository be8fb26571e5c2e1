from typing import ClassVar

from rest_framework import mixins

from controlplane.accounts.models import Role
from controlplane.api.base import FlotillaViewSet
from controlplane.audit.api.filters import AuditEntryFilter
from controlplane.audit.api.serializers import AuditEntrySerializer
from controlplane.audit.models import AuditEntry


class AuditEntryViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, FlotillaViewSet):
    """The audit log, newest first (read-only; operators and admins)."""

    queryset = AuditEntry.objects.all()
    serializer_class = AuditEntrySerializer
    filterset_class = AuditEntryFilter
    read_role: ClassVar = Role.OPERATOR
    ordering_fields: ClassVar = ["created_at", "id"]
