"""``/api/v1/instances/``: every pipeline's instances, a person's restart, and a worker's log tail."""

from typing import ClassVar

import django_filters
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, inline_serializer
from rest_framework import mixins, serializers
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.api.base import FlotillaViewSet
from controlplane.deployments import instances as instance_actions
from controlplane.deployments import log_tail
from controlplane.deployments.models import Instance
from runtime.fleet_contract.tasks import MAX_LOG_LINES


class InstanceSerializer(serializers.ModelSerializer):
    name = serializers.CharField(read_only=True)
    pipeline_name = serializers.CharField(source="pipeline.name", read_only=True)
    role = serializers.CharField(source="group.role", read_only=True)
    node = serializers.SlugRelatedField(slug_field="name", read_only=True)
    endpoint_instance_id = serializers.SerializerMethodField(
        help_text="The worker's instance id in etcd, in hex (as the gateway's x-flotilla-instance header shows it)"
    )

    class Meta:
        model = Instance
        fields: ClassVar = [
            "id",
            "name",
            "pipeline",
            "pipeline_name",
            "role",
            "replica",
            "node",
            "gpu_indexes",
            "state",
            "reason",
            "pid",
            "endpoint_instance_id",
            "restarts",
            "restart_requested",
            "gave_up",
            "replaces",
            "download_progress",
            "created_at",
            "state_changed_at",
            "updated_at",
        ]
        read_only_fields = fields

    def get_endpoint_instance_id(self, instance: Instance) -> str | None:
        return None if instance.endpoint_instance_id is None else f"{instance.endpoint_instance_id:x}"


class InstanceFilter(django_filters.FilterSet):
    node = django_filters.CharFilter(field_name="node__name")
    role = django_filters.CharFilter(field_name="group__role")
    pipeline_name = django_filters.CharFilter(field_name="pipeline__name")
    state = django_filters.MultipleChoiceFilter(choices=Instance.State.choices)
    placed = django_filters.BooleanFilter(field_name="node", lookup_expr="isnull", exclude=True)

    class Meta:
        model = Instance
        fields: ClassVar = ["pipeline", "node", "role", "state", "restart_requested"]


_LOG_REPLY = inline_serializer(
    "InstanceLog",
    {
        "instance": serializers.IntegerField(),
        "node": serializers.CharField(),
        "lines": serializers.IntegerField(),
        "text": serializers.CharField(),
    },
)


class InstanceViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, FlotillaViewSet):
    """Instances of all pipelines; ``restart`` needs operator."""

    queryset = Instance.objects.select_related("pipeline", "group", "node")
    serializer_class = InstanceSerializer
    filterset_class = InstanceFilter
    ordering_fields: ClassVar = ["id", "state", "state_changed_at", "restarts"]

    @extend_schema(request=None, responses=InstanceSerializer)
    @action(detail=True, methods=["post"])
    def restart(self, request: Request, pk: str) -> Response:
        """Stop and start the instance where it is (a failed one is started again)."""
        instance = instance_actions.restart_instance(self.actor, self.get_object())
        return Response(self.get_serializer(instance).data)

    @extend_schema(
        parameters=[
            OpenApiParameter("lines", int, description=f"how many of the last lines (1-{MAX_LOG_LINES}, default 100)"),
            OpenApiParameter(
                "grep",
                str,
                description=f"only the lines of those that contain this text, ignoring case (at most "
                f"{log_tail.MAX_GREP_CHARS} characters, one line)",
            ),
        ],
        responses={
            200: _LOG_REPLY,
            409: OpenApiResponse(description="the instance is not placed on a node"),
            502: OpenApiResponse(description="the node's agent answered with an error"),
            503: OpenApiResponse(description="the node is offline, did not answer in time, or the broker is down"),
        },
    )
    @action(detail=True, methods=["get"])
    def log(self, request: Request, pk: str) -> Response:
        """The last lines of the instance's worker log, as its node's agent keeps it."""
        lines = log_tail.parse_lines(request.query_params.get("lines"))
        grep = log_tail.parse_grep(request.query_params.get("grep"))
        tail = log_tail.log_tail(self.get_object(), lines)
        if tail.problem is not None:
            return Response({"detail": tail.problem}, status=tail.status)
        node = tail.instance.node
        assert node is not None  # a tail with text came from the node's agent
        text = log_tail.filter_lines(tail.text or "", grep)
        return Response({"instance": tail.instance.pk, "node": node.name, "lines": lines, "text": text})
