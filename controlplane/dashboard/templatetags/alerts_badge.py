"""``{% alerts_badge %}``: the nav's count of firing alerts (controlplane/dashboard/alerts.py)."""

from django import template
from django.utils.safestring import SafeString, mark_safe

from controlplane.dashboard.alerts import render_badge

register = template.Library()


@register.simple_tag
def alerts_badge() -> SafeString:
    return mark_safe(render_badge())  # rendered by a template, which escaped what it shows
