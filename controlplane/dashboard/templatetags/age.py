"""``{{ moment|age }}``: how long ago, as ``timesince`` says it, but in seconds under a minute.

Django's ``timesince`` says "0 minutes" for anything under a minute: a heartbeat 3 s old and one 59 s
old would read the same, and a replica that just became ready would be "ready 0 minutes".
"""

from datetime import datetime

from django import template
from django.utils import timezone
from django.utils.timesince import timesince

register = template.Library()


@register.filter
def age(moment: datetime | None, now: datetime | None = None) -> str:
    """``"12 seconds"`` under a minute (``"0 seconds"`` for a moment in the future), else ``timesince``."""
    if moment is None:
        return ""
    now = now or timezone.now()
    seconds = int((now - moment).total_seconds())
    if seconds < 60:
        seconds = max(seconds, 0)
        return f"{seconds} second" if seconds == 1 else f"{seconds} seconds"
    return timesince(moment, now)
