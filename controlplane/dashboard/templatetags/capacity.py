"""``{% cpu_warning instances cpus %}``: the CPU oversubscription warning of controlplane/dashboard/capacity.py."""

from django import template

from controlplane.dashboard.capacity import cpu_oversubscription

register = template.Library()


@register.simple_tag
def cpu_warning(cpu_instances: int | None, cpu_count: int | None) -> str:
    return cpu_oversubscription(cpu_instances, cpu_count)
