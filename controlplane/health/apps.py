from django.apps import AppConfig


class HealthConfig(AppConfig):
    name = "controlplane.health"
    label = "health"
    verbose_name = "Health: the reconciler's passes, checks and metrics"
