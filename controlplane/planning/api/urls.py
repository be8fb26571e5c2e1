from django.urls import re_path

from controlplane.api.base import ID_PATTERN
from controlplane.planning.api.views import PlannerDecisionViewSet

urlpatterns = [
    re_path(
        # A numeric id that fits the database's integers, as the routers' lookups are (controlplane/api/base.py).
        rf"^pipelines/(?P<pipeline_pk>{ID_PATTERN})/planner/decisions/$",
        PlannerDecisionViewSet.as_view({"get": "list"}),
        name="pipeline-planner-decisions",
    ),
]
