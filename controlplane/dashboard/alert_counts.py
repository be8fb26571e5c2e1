"""How many alerts fire now, and how often the pages that show it (the nav's badge, the Overview's line) ask
again: shared by the Alerts views and the Overview, which the Alerts views import from."""

from controlplane.alerts.models import Alert

#: Seconds between two refreshes of the count on a page.
BADGE_EVERY_S = 10


def firing_count() -> int:
    return Alert.objects.filter(resolved_at=None).count()
