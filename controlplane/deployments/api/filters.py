from typing import ClassVar

import django_filters

from controlplane.deployments.models import Pipeline


class PipelineFilter(django_filters.FilterSet):
    model = django_filters.CharFilter(field_name="model__name")
    name_contains = django_filters.CharFilter(field_name="name", lookup_expr="icontains")

    class Meta:
        model = Pipeline
        fields: ClassVar = ["name", "namespace", "model", "state", "router_mode", "placement_policy"]
