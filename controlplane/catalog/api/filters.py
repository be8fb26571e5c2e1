from typing import ClassVar

import django_filters

from controlplane.catalog.models import LanguageModel


class ModelFilter(django_filters.FilterSet):
    name_contains = django_filters.CharFilter(field_name="name", lookup_expr="icontains")

    class Meta:
        model = LanguageModel
        fields: ClassVar = ["name", "engine", "source_kind"]
