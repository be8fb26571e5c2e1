from django.apps import AppConfig


class TrafficConfig(AppConfig):
    """What the fleet served: the request log (one row per request a gateway finished) and the metric samples
    computed from it and from the workers' and nodes' reports, for the dashboard's charts with history."""

    name = "controlplane.traffic"
    label = "traffic"
    default_auto_field = "django.db.models.BigAutoField"
