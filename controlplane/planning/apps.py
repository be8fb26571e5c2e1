from django.apps import AppConfig


class PlanningConfig(AppConfig):
    name = "controlplane.planning"
    label = "planning"
    verbose_name = "Planning: the planner's loop and the decisions it made"
