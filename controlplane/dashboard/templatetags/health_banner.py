"""``{% health_banner %}``: the banner of controlplane/dashboard/health_banner.py, rendered with the page."""

from django import template
from django.utils.safestring import SafeString, mark_safe

from controlplane.dashboard.health_banner import render_banner

register = template.Library()


@register.simple_tag
def health_banner() -> SafeString:
    return mark_safe(render_banner())  # rendered by a template, which escaped what it shows
