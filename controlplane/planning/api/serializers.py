from typing import ClassVar

from rest_framework import serializers

from controlplane.planning.models import PlannerDecision


class PlannerDecisionSerializer(serializers.ModelSerializer):
    """One group's decision; ``ttft_s``/``itl_s`` measured at ``percentile`` over the interval, ``predicted_*``
    the traffic expected over the next one (requests/s, mean prompt and completion tokens)."""

    class Meta:
        model = PlannerDecision
        fields: ClassVar = [
            "id",
            "role",
            "at",
            "current",
            "desired",
            "wanted",
            "mode",
            "bound",
            "advisory",
            "acted",
            "reason",
            "percentile",
            "ttft_s",
            "itl_s",
            "predicted_rate",
            "predicted_isl",
            "predicted_osl",
        ]
        read_only_fields = fields
