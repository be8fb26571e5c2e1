from typing import Any, ClassVar

from django.db.models import QuerySet
from drf_spectacular.utils import OpenApiResponse, extend_schema, inline_serializer
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.accounts.authentication import AgentPrincipal
from controlplane.accounts.models import Role
from controlplane.api.base import ID_PATTERN, FlotillaViewSet
from controlplane.api.permissions import AgentPermission
from controlplane.audit.records import Actor
from controlplane.deployments import evacuation
from controlplane.deployments import instances as instance_actions
from controlplane.deployments.api.instances import InstanceSerializer
from controlplane.deployments.instance_states import InstanceState
from controlplane.deployments.models import Instance
from controlplane.errors import Forbidden
from controlplane.fleet import actions as fleet_actions
from controlplane.fleet.api.filters import DownloadFilter, NodeFilter
from controlplane.fleet.api.serializers import (
    AgentInstanceSerializer,
    DownloadReportSerializer,
    DownloadSerializer,
    DrainSerializer,
    InstanceReportSerializer,
    NodeRegistrationSerializer,
    NodeReportSerializer,
    NodeSerializer,
)
from controlplane.fleet.machines import audit_other_machine
from controlplane.fleet.models import Download, Node


class NodeViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.DestroyModelMixin, FlotillaViewSet):
    """Nodes as their agents report them. Drain, cordon and their undoing need operator; deleting a node
    needs admin."""

    queryset = Node.objects.all()  # the serializer reads GPUs as plain rows, one query per page
    serializer_class = NodeSerializer
    filterset_class = NodeFilter
    ordering_fields: ClassVar = ["name", "last_heartbeat_at", "registered_at"]
    action_roles: ClassVar = {"destroy": Role.ADMIN}

    @extend_schema(
        request=DrainSerializer,
        responses={
            200: NodeSerializer,
            409: OpenApiResponse(description="draining already, or some replacement fits on no other node"),
        },
    )
    @action(detail=True, methods=["post"])
    def drain(self, request: Request, pk: str) -> Response:
        """Place nothing new here and move this node's instances elsewhere: each stops once its replacement
        is ready. Refused (409, naming the pipelines) when a replacement fits nowhere, unless ``force``."""
        options = DrainSerializer(data=request.data or {})
        options.is_valid(raise_exception=True)
        node = evacuation.drain_node(self.actor, self.get_object(), force=options.validated_data["force"])
        return Response(self.get_serializer(node).data)

    @extend_schema(request=None, responses=NodeSerializer)
    @action(detail=True, methods=["post"])
    def undrain(self, request: Request, pk: str) -> Response:
        """Let new instances be placed here again."""
        node = evacuation.undrain_node(self.actor, self.get_object())
        return Response(self.get_serializer(node).data)

    @extend_schema(request=None, responses=NodeSerializer)
    @action(detail=True, methods=["post"])
    def cordon(self, request: Request, pk: str) -> Response:
        """Place nothing new here; what runs here stays."""
        node = fleet_actions.cordon_node(self.actor, self.get_object())
        return Response(self.get_serializer(node).data)

    @extend_schema(request=None, responses=NodeSerializer)
    @action(detail=True, methods=["post"])
    def uncordon(self, request: Request, pk: str) -> Response:
        """Let new instances be placed here again."""
        node = fleet_actions.uncordon_node(self.actor, self.get_object())
        return Response(self.get_serializer(node).data)

    def perform_destroy(self, instance: Node) -> None:
        evacuation.delete_node(self.actor, instance)


class DownloadViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, FlotillaViewSet):
    """Model files on each node, as the agents report them."""

    queryset = Download.objects.select_related("node", "model")
    serializer_class = DownloadSerializer
    filterset_class = DownloadFilter
    ordering_fields: ClassVar = ["updated_at", "state"]


_HEARTBEAT_REPLY = inline_serializer(
    "HeartbeatReply",
    {"name": serializers.CharField(), "state": serializers.CharField(), "draining": serializers.BooleanField()},
)


class AgentViewSet(viewsets.ViewSet):
    """The endpoints a node's agent calls, with that node's agent token (and only for that node)."""

    permission_classes: ClassVar = [AgentPermission]
    serializer_class = NodeReportSerializer

    @property
    def node_name(self) -> str:
        principal = self.request.user
        assert isinstance(principal, AgentPrincipal)  # AgentPermission let only agents in
        return principal.node_name

    @property
    def actor(self) -> Actor:
        return Actor.agent(self.node_name)

    @extend_schema(
        request=NodeRegistrationSerializer,
        responses={200: NodeSerializer, 409: OpenApiResponse(description="another machine registered this node")},
    )
    @action(detail=False, methods=["post"])
    def register(self, request: Request) -> Response:
        """Register (or re-register) this agent's node with its inventory."""
        report = self._report(NodeRegistrationSerializer, request)
        with audit_other_machine(self.actor):
            node = fleet_actions.register_node(self.actor, self.node_name, report)
        return Response(NodeSerializer(node).data)

    @extend_schema(
        request=NodeReportSerializer,
        responses={200: _HEARTBEAT_REPLY, 409: OpenApiResponse(description="another machine registered this node")},
    )
    @action(detail=False, methods=["post"])
    def heartbeat(self, request: Request) -> Response:
        """Report the node's current inventory; it keeps the node online."""
        with audit_other_machine(self.actor):
            node = fleet_actions.heartbeat(self.actor, self.node_name, self._report(NodeReportSerializer, request))
        return Response({"name": node.name, "state": node.state, "draining": node.draining})

    @extend_schema(responses=AgentInstanceSerializer(many=True))
    @action(detail=False, methods=["get"])
    def instances(self, request: Request) -> Response:
        """The instances placed on this node that are not stopped, with what it takes to run them."""
        instances = self._node_instances()
        return Response(AgentInstanceSerializer(instances, many=True).data)

    @extend_schema(
        request=InstanceReportSerializer,
        responses={200: InstanceSerializer, 409: OpenApiResponse(description="the state cannot follow the current")},
    )
    @action(detail=False, methods=["post"], url_path=rf"instances/(?P<instance_id>{ID_PATTERN})/state")
    def instance_state(self, request: Request, instance_id: str) -> Response:
        """Report an instance's state (and its pid, endpoint instance id, download progress)."""
        serializer = InstanceReportSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        instance = instance_actions.report_instance_state(
            self.actor, self.node_name, int(instance_id), serializer.to_report()
        )
        return Response(InstanceSerializer(instance).data)

    @extend_schema(request=DownloadReportSerializer, responses=DownloadSerializer)
    @action(detail=False, methods=["post"])
    def downloads(self, request: Request) -> Response:
        """Report the progress of a model download on this node."""
        serializer = DownloadReportSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        model = serializer.validated_data["model"]
        download = fleet_actions.report_download(self.actor, self.node_name, model.pk, serializer.to_report())
        return Response(DownloadSerializer(download).data, status=status.HTTP_200_OK)

    def _report(self, serializer_class: Any, request: Request) -> Any:
        serializer = serializer_class(data=request.data)
        serializer.is_valid(raise_exception=True)
        name = serializer.validated_data.get("name")
        if name is not None and name != self.node_name:
            raise Forbidden(f"this token belongs to node {self.node_name}, not {name}")
        return serializer.to_report()

    def _node_instances(self) -> QuerySet[Instance]:
        return (
            Instance.objects.select_related("pipeline__model", "group", "node")
            .filter(node__name=self.node_name)
            .exclude(state=InstanceState.STOPPED)
            .order_by("id")
        )
