"""``{{ value|bytes }}``: a byte count as people read it (the placement messages' format)."""

from django import template

from controlplane.deployments.placement import format_bytes

register = template.Library()


@register.filter(name="bytes")
def bytes_filter(value: int | None) -> str:
    return "?" if value is None else format_bytes(int(value))
