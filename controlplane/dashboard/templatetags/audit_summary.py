"""``{{ entry|summary }}``: what an audit entry changed, in one line (controlplane/dashboard/audit_summary.py)."""

from django import template

from controlplane.audit.models import AuditEntry
from controlplane.dashboard import audit_summary

register = template.Library()


@register.filter
def summary(entry: AuditEntry) -> str:
    return audit_summary.summarize(entry.action, entry.before, entry.after)
