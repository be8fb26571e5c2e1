from typing import Any, ClassVar

import msgspec
from rest_framework import serializers

from controlplane.api.fields import LabelsField
from controlplane.catalog.models import LanguageModel
from controlplane.deployments.instances import AGENT_REPORTABLE_CHOICES
from controlplane.deployments.models import Instance
from controlplane.deployments.worker_specs import merged_engine_args
from controlplane.fleet.machines import MACHINE_ID_PATTERN
from controlplane.fleet.models import NODE_NAME_PATTERN, Download, Gpu, Node
from runtime.fleet_contract.engine_names import ENGINE_LABELS, FLEET_ENGINES
from runtime.fleet_contract.reports import DownloadReport, InstanceReport, NodeReport
from runtime.fleet_contract.tasks import GPU_UUID_PATTERN, INCARNATION_PATTERN

MAX_BYTES = 2**53
MAX_GPUS_PER_NODE = 64
# A node reports each of the fleet's engines at most once; room for a few more keeps a newer agent (which may
# know an engine this control plane does not) answered by name rather than by a count.
MAX_ENGINES_PER_NODE = 32
MAX_INSTANCE_ID = 2**63 - 1
# What a heartbeat may say of adapters it could not fetch (the agent sends at most as many: agent/adapter_files.py).
MAX_ADAPTER_FAILURES = 64
MAX_ADAPTER_FAILURE_REASON = 500


# What people read.


GPU_FIELDS = ("index", "name", "uuid", "memory_total_bytes", "memory_used_bytes", "utilization_percent")


class GpuSerializer(serializers.ModelSerializer):
    """A GPU as people read it. Lists of nodes pass plain rows (see ``gpu_rows``), written as they are."""

    class Meta:
        model = Gpu
        fields: ClassVar = list(GPU_FIELDS)

    def to_representation(self, gpu: Gpu | dict[str, Any]) -> dict[str, Any]:
        # DRF's field-by-field path costs ~0.1 ms a GPU: 40 ms for a page of 50 nodes with 8 GPUs each.
        if isinstance(gpu, dict):
            return gpu
        return {field: getattr(gpu, field) for field in GPU_FIELDS}


def gpu_rows(node_ids: list[int]) -> dict[int, list[dict[str, Any]]]:
    """The GPUs of ``node_ids`` as plain rows by node, in index order, in one query (no model objects)."""
    rows: dict[int, list[dict[str, Any]]] = {node_id: [] for node_id in node_ids}
    values = Gpu.objects.filter(node_id__in=node_ids).order_by("node_id", "index").values_list("node_id", *GPU_FIELDS)
    for node_id, *fields in values:
        rows[node_id].append(dict(zip(GPU_FIELDS, fields, strict=True)))
    return rows


class NodeListSerializer(serializers.ListSerializer):
    """A page of nodes, their GPUs read in one query for the whole page."""

    def to_representation(self, data: Any) -> list[dict[str, Any]]:
        nodes = list(data.all() if hasattr(data, "all") else data)
        rows = gpu_rows([node.pk for node in nodes])
        for node in nodes:
            node.gpu_rows = rows[node.pk]
        return super().to_representation(nodes)


class NodeSerializer(serializers.ModelSerializer):
    gpus = GpuSerializer(many=True, read_only=True, source="gpu_rows")
    schedulable = serializers.BooleanField(read_only=True)

    class Meta:
        model = Node
        list_serializer_class = NodeListSerializer
        fields: ClassVar = [
            "id",
            "name",
            "address",
            "labels",
            "state",
            "cordoned",
            "draining",
            "schedulable",
            "last_heartbeat_at",
            "cpu_count",
            "memory_total_bytes",
            "memory_available_bytes",
            "cpu_utilization_percent",
            "agent_version",
            "machine_id",
            "engines",
            "gpus",
            "registered_at",
            "updated_at",
        ]
        read_only_fields = fields

    def to_representation(self, node: Node) -> dict[str, Any]:
        if not hasattr(node, "gpu_rows"):  # one node, not a page of them
            node.gpu_rows = gpu_rows([node.pk])[node.pk]
        return super().to_representation(node)


class DrainSerializer(serializers.Serializer):
    force = serializers.BooleanField(
        default=False,
        help_text="Drain even when some replacement fits on no other node: those replicas stop at once",
    )


class DownloadSerializer(serializers.ModelSerializer):
    node = serializers.SlugRelatedField(slug_field="name", read_only=True)
    model_name = serializers.CharField(source="model.name", read_only=True)
    progress = serializers.FloatField(read_only=True, allow_null=True)

    class Meta:
        model = Download
        fields: ClassVar = [
            "id",
            "node",
            "model",
            "model_name",
            "state",
            "bytes_done",
            "bytes_total",
            "progress",
            "error",
            "started_at",
            "updated_at",
        ]
        read_only_fields = fields


# What agents send: the reports of runtime/fleet_contract/reports.py, each checked against the limits here and then
# converted into its report (``to_report``). tests/controlplane/test_agent_reports.py holds each serializer
# to its report field for field: the same names, required where the report has no default, and defaults equal.


class GpuReportSerializer(serializers.Serializer):
    index = serializers.IntegerField(min_value=0, max_value=MAX_GPUS_PER_NODE - 1)
    name = serializers.CharField(max_length=128, allow_blank=True, default="")
    uuid = serializers.RegexField(GPU_UUID_PATTERN, max_length=96, allow_blank=True, default="")
    memory_total_bytes = serializers.IntegerField(min_value=0, max_value=MAX_BYTES)
    memory_used_bytes = serializers.IntegerField(min_value=0, max_value=MAX_BYTES, default=0)
    utilization_percent = serializers.IntegerField(min_value=0, max_value=100, default=0)


class AdapterFailureSerializer(serializers.Serializer):
    pipeline_id = serializers.IntegerField(min_value=1)
    adapter = serializers.CharField(max_length=128)
    reason = serializers.CharField(max_length=MAX_ADAPTER_FAILURE_REASON, allow_blank=True)


class NodeReportSerializer(serializers.Serializer):
    """A node's inventory; ``name``, when given, must be the token's node."""

    name = serializers.RegexField(NODE_NAME_PATTERN, max_length=63, required=False)
    address = serializers.CharField(max_length=255, allow_blank=True, default="")
    labels = LabelsField(default=dict)
    cpu_count = serializers.IntegerField(min_value=0, max_value=1 << 20, default=0)
    memory_total_bytes = serializers.IntegerField(min_value=0, max_value=MAX_BYTES, default=0)
    memory_available_bytes = serializers.IntegerField(min_value=0, max_value=MAX_BYTES, default=0)
    agent_version = serializers.CharField(max_length=64, allow_blank=True, default="")
    gpus = GpuReportSerializer(many=True, default=list, max_length=MAX_GPUS_PER_NODE)
    machine_id = serializers.RegexField(
        MACHINE_ID_PATTERN,
        max_length=128,
        allow_blank=True,
        default="",
        help_text="The machine the agent runs on (/etc/machine-id): another machine's report for this node is a 409.",
    )
    engines = serializers.ListField(
        child=serializers.CharField(max_length=64),
        max_length=MAX_ENGINES_PER_NODE,
        required=False,
        help_text="The engines the agent can run here (the fleet's names); left out: those the node had.",
    )
    # Not bounded here: a figure out of 0..100 must not cost the node its heartbeat (it would go offline); the
    # action ignores such a figure, logged (controlplane/fleet/actions.py).
    cpu_utilization_percent = serializers.FloatField(
        required=False,
        help_text="Percent of all the node's CPUs' time busy since its previous report; outside 0..100: ignored.",
    )

    adapter_failures = AdapterFailureSerializer(
        many=True,
        required=False,
        max_length=MAX_ADAPTER_FAILURES,
        help_text="The LoRA adapters the node could not fetch for its pipelines' workers, and why ([]: none); "
        "left out: those the node had.",
    )

    def validate_engines(self, engines: list[str]) -> list[str]:
        """The node's own word, believed only for the fleet's engines: any other name is refused by name."""
        unknown = sorted(set(engines) - FLEET_ENGINES)
        if unknown:
            names = ", ".join(repr(name[:64]) for name in unknown)
            raise serializers.ValidationError(
                f"not an engine of this fleet: {names}; the fleet's engines are {', '.join(ENGINE_LABELS)}"
            )
        return sorted(set(engines))

    def validate_gpus(self, gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
        indexes = [gpu["index"] for gpu in gpus]
        if len(set(indexes)) != len(indexes):
            raise serializers.ValidationError("GPU indexes must be unique.")
        return gpus

    def to_report(self) -> NodeReport:
        return msgspec.convert(self.validated_data, NodeReport)


class NodeRegistrationSerializer(NodeReportSerializer):
    name = serializers.RegexField(NODE_NAME_PATTERN, max_length=63)


class InstanceReportSerializer(serializers.Serializer):
    state = serializers.ChoiceField(choices=AGENT_REPORTABLE_CHOICES)
    reason = serializers.CharField(max_length=4000, allow_blank=True, default="")
    pid = serializers.IntegerField(min_value=1, max_value=2**31 - 1, required=False, allow_null=True)
    endpoint_instance_id = serializers.IntegerField(min_value=1, max_value=MAX_INSTANCE_ID, required=False)
    download_progress = serializers.FloatField(min_value=0.0, max_value=1.0, required=False)
    attempt = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False)
    incarnation = serializers.RegexField(INCARNATION_PATTERN, required=False)
    permanent = serializers.BooleanField(default=False)

    def validate(self, data: dict[str, Any]) -> dict[str, Any]:
        if data["state"] == Instance.State.FAILED and not data.get("reason"):
            raise serializers.ValidationError({"reason": ["Say why the instance failed."]})
        return data

    def to_report(self) -> InstanceReport:
        return msgspec.convert(self.validated_data, InstanceReport)


class DownloadReportSerializer(serializers.Serializer):
    model = serializers.PrimaryKeyRelatedField(queryset=LanguageModel.objects.all())
    state = serializers.ChoiceField(choices=Download.State.choices)
    bytes_done = serializers.IntegerField(min_value=0, max_value=MAX_BYTES, default=0)
    bytes_total = serializers.IntegerField(min_value=0, max_value=MAX_BYTES, required=False, allow_null=True)
    error = serializers.CharField(max_length=4000, allow_blank=True, default="")
    projector_bytes = serializers.IntegerField(
        min_value=0,
        max_value=MAX_BYTES,
        required=False,
        allow_null=True,
        help_text="with done: the size on disk of the model's multimodal projector (llama.cpp's mmproj), which a "
        "replica loads beside the weights",
    )

    def to_report(self) -> DownloadReport:
        """The report, without ``model``: the model it is about is sent beside it."""
        data = dict(self.validated_data)
        data.pop("model")
        return msgspec.convert(data, DownloadReport)


class AgentInstanceSerializer(serializers.ModelSerializer):
    """What an agent needs to run an instance: where to serve, which engine and files, on which GPUs."""

    name = serializers.CharField(read_only=True)
    served_model_name = serializers.CharField(source="pipeline.name", read_only=True)
    endpoint = serializers.CharField(source="group.endpoint", read_only=True)
    role = serializers.CharField(source="group.role", read_only=True)
    engine = serializers.CharField(source="group.engine", read_only=True)
    engine_args = serializers.SerializerMethodField()
    model = serializers.SerializerMethodField()
    router = serializers.SerializerMethodField()
    # The attempt its start tasks name: an agent stops a worker of an older one.
    attempt = serializers.IntegerField(source="restarts", read_only=True)

    class Meta:
        model = Instance
        fields: ClassVar = [
            "id",
            "name",
            "state",
            "attempt",
            "incarnation",
            "restart_requested",
            "replica",
            "role",
            "gpu_indexes",
            "served_model_name",
            "endpoint",
            "engine",
            "engine_args",
            "model",
            "router",
        ]
        read_only_fields = fields

    def get_engine_args(self, instance: Instance) -> dict[str, Any]:
        return merged_engine_args(instance)

    def get_model(self, instance: Instance) -> dict[str, Any]:
        model = instance.pipeline.model
        return {
            "id": model.pk,
            "name": model.name,
            "source_kind": model.source_kind,
            "source": model.source,
            "revision": model.revision,
            "filename": model.filename,
        }

    def get_router(self, instance: Instance) -> dict[str, Any]:
        pipeline = instance.pipeline
        return {
            "mode": pipeline.router_mode,
            "kv_overlap_score_weight": pipeline.kv_overlap_score_weight,
            "kv_queued_prefill_weight": pipeline.kv_queued_prefill_weight,
            "temperature": pipeline.router_temperature,
            "use_kv_events": pipeline.use_kv_events,
            "kv_host_hit_weight": pipeline.kv_host_hit_weight,
            "kv_disk_hit_weight": pipeline.kv_disk_hit_weight,
            "disagg_policy": pipeline.disagg_policy,
            "disagg_isl_threshold": pipeline.disagg_isl_threshold,
            "disagg_isl_ratio": pipeline.disagg_isl_ratio,
            "disagg_prefill_busy": pipeline.disagg_prefill_busy,
            "disagg_decode_busy": pipeline.disagg_decode_busy,
        }
