from typing import ClassVar

import django_filters
from django.db.models import CharField, QuerySet
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Cast

from controlplane.fleet.models import Download, Node


class NodeFilter(django_filters.FilterSet):
    label = django_filters.CharFilter(method="filter_label", help_text="key=value, or key: nodes with this label")

    class Meta:
        model = Node
        fields: ClassVar = ["name", "state", "draining"]

    def filter_label(self, queryset: QuerySet[Node], name: str, value: str) -> QuerySet[Node]:
        key, has_value, wanted = value.partition("=")
        if not has_value:
            return queryset.filter(labels__has_key=key)
        # A key transform rather than labels__<key>: the key is user input and must not become a lookup path.
        # The cast makes the comparison one of text on SQLite and PostgreSQL alike.
        label = Cast(KeyTextTransform(key, "labels"), CharField())
        return queryset.annotate(label_value=label).filter(label_value=wanted)


class DownloadFilter(django_filters.FilterSet):
    node = django_filters.CharFilter(field_name="node__name")

    class Meta:
        model = Download
        fields: ClassVar = ["node", "model", "state"]
