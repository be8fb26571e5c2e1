from django.apps import AppConfig


class AlertsConfig(AppConfig):
    name = "controlplane.alerts"
    label = "alerts"
    verbose_name = "Alerts: what needs an operator, and the silences that quiet it"
