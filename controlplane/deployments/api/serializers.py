from typing import Any, ClassVar

from rest_framework import serializers

from controlplane.api.fields import JsonObjectField
from controlplane.catalog.engines import Engine
from controlplane.catalog.models import LanguageModel
from controlplane.deployments.adapters import pipeline_max_loras
from controlplane.deployments.instance_states import LIVE_STATES, InstanceState
from controlplane.deployments.models import (
    NAMESPACE_PATTERN,
    SERVED_NAME_PATTERN,
    DisaggPolicy,
    Pipeline,
    PlacementPolicy,
    RouterMode,
    WorkerGroup,
)
from controlplane.deployments.pipelines import (
    MAX_GPUS_PER_REPLICA,
    MAX_HOST_CACHE_GIB,
    MAX_ISL_THRESHOLD,
    MAX_PREFILL_BUSY,
    MAX_REPLICAS,
    MAX_ROUTER_TEMPERATURE,
    MAX_ROUTER_WEIGHT,
    MAX_TTFT_TARGET_MS,
    GroupSpec,
    served_name_taken,
    served_name_taken_message,
)
from controlplane.errors import Invalid
from controlplane.fleet.models import NODE_NAME_PATTERN, Node
from planner.errors import SettingsError
from planner.targets_json import targets_from_dict
from runtime.fleet_contract.router_settings import (
    DEFAULT_DISK_HIT_WEIGHT,
    DEFAULT_HOST_HIT_WEIGHT,
    DEFAULT_ISL_RATIO,
    DEFAULT_ISL_THRESHOLD,
    DEFAULT_PREFILL_BUSY,
    DEFAULT_QUEUED_PREFILL_WEIGHT,
)

MAX_PINS = 64


class PlannerSettingsField(JsonObjectField):
    """``planner``: the planner's targets for the pipeline (docs/planner.md); null turns the planner off.
    A setting it cannot plan with is a 400 naming its path (``{"planner": {"default.ttft_s": [...]}}``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(
            allow_null=True,
            help_text="The planner's targets (docs/planner.md: enabled, advisory, default, groups, gpu_budget, "
            "load, stability); null: the planner leaves this pipeline alone.",
            **kwargs,
        )

    def to_internal_value(self, data: Any) -> Any:
        value = super().to_internal_value(data)
        try:
            targets_from_dict(value)
        except SettingsError as exc:
            raise serializers.ValidationError({exc.field or "non_field_errors": [exc.message]}) from exc
        return value


class RouterSerializer(serializers.Serializer):
    """How the gateway spreads requests over the pipeline's workers (``--router-mode`` and friends)."""

    mode = serializers.ChoiceField(source="router_mode", choices=RouterMode.choices, default=RouterMode.ROUND_ROBIN)
    kv_overlap_score_weight = serializers.FloatField(min_value=0.0, max_value=MAX_ROUTER_WEIGHT, default=1.0)
    kv_queued_prefill_weight = serializers.FloatField(
        min_value=0.0, max_value=1.0, default=DEFAULT_QUEUED_PREFILL_WEIGHT
    )
    temperature = serializers.FloatField(
        source="router_temperature", min_value=0.0, max_value=MAX_ROUTER_TEMPERATURE, default=0.0
    )
    use_kv_events = serializers.BooleanField(default=True)
    kv_host_hit_weight = serializers.FloatField(
        min_value=0.0,
        max_value=1.0,
        default=DEFAULT_HOST_HIT_WEIGHT,
        help_text="kv mode: what a prompt block in a worker's host-memory tier is worth against one on its GPU (1).",
    )
    kv_disk_hit_weight = serializers.FloatField(
        min_value=0.0,
        max_value=1.0,
        default=DEFAULT_DISK_HIT_WEIGHT,
        help_text="kv mode: the same for a block on a disk tier or in a store outside the node.",
    )
    disagg_policy = serializers.ChoiceField(choices=DisaggPolicy.choices, default=DisaggPolicy.ALWAYS)
    disagg_isl_threshold = serializers.IntegerField(
        min_value=0, max_value=MAX_ISL_THRESHOLD, default=DEFAULT_ISL_THRESHOLD
    )
    disagg_isl_ratio = serializers.FloatField(min_value=0.0, max_value=1.0, default=DEFAULT_ISL_RATIO)
    disagg_decode_busy = serializers.FloatField(min_value=0.0, max_value=1.0, allow_null=True, default=None)
    disagg_prefill_busy = serializers.FloatField(
        min_value=0.001, max_value=MAX_PREFILL_BUSY, default=DEFAULT_PREFILL_BUSY
    )


class HostCacheField(serializers.FloatField):
    """``kv_host_cache_gib``: GiB of host memory per replica as a KV tier below the device; null reads as 0."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(
            min_value=0.0,
            max_value=MAX_HOST_CACHE_GIB,
            allow_null=True,
            help_text="GiB of host memory each replica keeps as a KV cache tier below its GPU (mocker, vllm, "
            "sglang; the node must have it free); 0 or null: none. A change restarts the workers, one at a time.",
            **kwargs,
        )

    def validate_empty_values(self, data: Any) -> tuple[bool, Any]:
        # null is a value here (no host tier), not an absent field: it goes through to_internal_value.
        if data is None:
            return True, 0.0
        return super().validate_empty_values(data)


class PlacementSerializer(serializers.Serializer):
    """Where replicas go: the policy, and optional pins to node names and GPU indexes."""

    policy = serializers.ChoiceField(
        source="placement_policy", choices=PlacementPolicy.choices, default=PlacementPolicy.SPREAD
    )
    nodes = serializers.ListField(
        source="pinned_nodes",
        child=serializers.RegexField(NODE_NAME_PATTERN, max_length=63),
        max_length=MAX_PINS,
        default=list,
    )
    gpus = serializers.ListField(
        source="pinned_gpus",
        child=serializers.IntegerField(min_value=0, max_value=63),
        max_length=MAX_PINS,
        default=list,
    )

    def validate_nodes(self, names: list[str]) -> list[str]:
        if len(set(names)) != len(names):
            raise serializers.ValidationError("Each node once.")
        known = set(Node.objects.filter(name__in=names).values_list("name", flat=True))
        unknown = [name for name in names if name not in known]
        if unknown:
            raise serializers.ValidationError(f"No node is named {unknown[0]!r}.")
        return names

    def validate_gpus(self, indexes: list[int]) -> list[int]:
        if len(set(indexes)) != len(indexes):
            raise serializers.ValidationError("Each GPU index once.")
        return sorted(indexes)


class WorkerGroupSerializer(serializers.ModelSerializer):
    engine = serializers.ChoiceField(choices=Engine.choices, required=False, help_text="Left out: the model's engine.")
    replicas = serializers.IntegerField(min_value=0, max_value=MAX_REPLICAS, default=1)
    gpus_per_replica = serializers.IntegerField(
        min_value=0, max_value=MAX_GPUS_PER_REPLICA, default=0, help_text="Tensor-parallel size; 0 runs on CPU."
    )
    engine_args = JsonObjectField(required=False, default=dict, help_text="Laid over the model's default args.")
    component = serializers.CharField(read_only=True)
    endpoint = serializers.CharField(read_only=True)
    instances = serializers.SerializerMethodField(help_text="How many of the group's instances are in each state.")
    generation = serializers.IntegerField(read_only=True, help_text="Bumped by each update its workers restart for.")
    outdated = serializers.SerializerMethodField(
        help_text="Its instances still running an older generation: a rolling update replaces them one by one."
    )

    class Meta:
        model = WorkerGroup
        fields: ClassVar = [
            "role",
            "engine",
            "replicas",
            "gpus_per_replica",
            "engine_args",
            "component",
            "endpoint",
            "instances",
            "generation",
            "outdated",
        ]
        extra_kwargs: ClassVar = {"role": {"default": WorkerGroup.Role.AGGREGATED}}

    def get_instances(self, group: WorkerGroup) -> dict[str, int]:
        # The viewsets annotate n_<state> counts in one query; other callers get them counted here.
        if hasattr(group, f"n_{InstanceState.PENDING}"):
            counts = {state: getattr(group, f"n_{state}") for state in InstanceState.values}
        else:
            counts = {state: group.instances.filter(state=state).count() for state in InstanceState.values}
        return {state: count for state, count in counts.items() if count}

    def get_outdated(self, group: WorkerGroup) -> int:
        if group.pk is None:
            return 0
        return group.instances.filter(state__in=LIVE_STATES, generation__lt=group.generation).count()


class TtftTargetField(serializers.IntegerField):
    """``ttft_target_ms``: the TTFT p95 (ms) above which an alert fires; null: no target."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(
            min_value=1,
            max_value=MAX_TTFT_TARGET_MS,
            allow_null=True,
            help_text="The time to first token (p95, milliseconds) above which an alert fires; null: no target.",
            **kwargs,
        )


class GroupUpdateSerializer(serializers.Serializer):
    """What an update of a worker group may change; its instances are then replaced one at a time."""

    role = serializers.ChoiceField(
        choices=WorkerGroup.Role.choices, required=False, help_text="Which group; needed when there are several."
    )
    engine_args = JsonObjectField(required=False, help_text="The group's engine args (replacing the old ones).")
    gpus_per_replica = serializers.IntegerField(min_value=0, max_value=MAX_GPUS_PER_REPLICA, required=False)

    def validate(self, data: dict[str, Any]) -> dict[str, Any]:
        if "engine_args" not in data and "gpus_per_replica" not in data:
            raise serializers.ValidationError("Give engine_args, gpus_per_replica or both.")
        return data


class PipelineSerializer(serializers.ModelSerializer):
    """A pipeline; POST deploys one (groups, router and placement given once, at deploy)."""

    name = serializers.RegexField(
        SERVED_NAME_PATTERN, max_length=200, help_text="The served model name clients ask for."
    )
    namespace = serializers.RegexField(
        NAMESPACE_PATTERN, max_length=64, required=False, help_text="dyn:// namespace; derived from the name."
    )
    model = serializers.SlugRelatedField(slug_field="name", queryset=LanguageModel.objects.all())
    router = RouterSerializer(source="*", required=False)
    kv_host_cache_gib = HostCacheField(default=0.0)
    placement = PlacementSerializer(source="*", required=False)
    planner = PlannerSettingsField(required=False, default=None)
    ttft_target_ms = TtftTargetField(required=False, default=None)
    groups = WorkerGroupSerializer(many=True, min_length=1, max_length=2)

    class Meta:
        model = Pipeline
        fields: ClassVar = [
            "id",
            "name",
            "namespace",
            "model",
            "state",
            "router",
            "kv_host_cache_gib",
            "placement",
            "planner",
            "ttft_target_ms",
            "groups",
            "created_at",
            "updated_at",
        ]
        read_only_fields: ClassVar = ["id", "state", "created_at", "updated_at"]

    def validate_name(self, name: str) -> str:
        if (taken := served_name_taken(name)) is not None:
            message = served_name_taken_message(name, taken)
            raise serializers.ValidationError(f"{message[:1].upper()}{message[1:]}.")
        return name

    def validate_namespace(self, namespace: str) -> str:
        if Pipeline.objects.filter(namespace=namespace).exists():
            raise serializers.ValidationError(f"Namespace {namespace!r} belongs to another pipeline.")
        return namespace

    def validate(self, data: dict[str, Any]) -> dict[str, Any]:
        _check_pins_hold_a_replica(
            data.get("pinned_gpus") or [], [group["gpus_per_replica"] for group in data["groups"]]
        )
        return data

    def deploy_arguments(self) -> dict[str, Any]:
        """The validated body as ``deploy_pipeline``'s keyword arguments."""
        data = dict(self.validated_data)
        data["groups"] = [GroupSpec(**group) for group in data["groups"]]
        return data


class PipelineUpdateSerializer(serializers.Serializer):
    """What PATCH may change: router settings, the host KV tier, placement and the planner's targets (name,
    model and groups are fixed; scale changes replicas)."""

    router = RouterSerializer(source="*", required=False)
    kv_host_cache_gib = HostCacheField(required=False)
    placement = PlacementSerializer(source="*", required=False)
    planner = PlannerSettingsField(required=False)
    ttft_target_ms = TtftTargetField(required=False)

    def validate(self, data: dict[str, Any]) -> dict[str, Any]:
        fixed = sorted(set(self.initial_data) - set(self.fields)) if isinstance(self.initial_data, dict) else []
        if fixed:
            raise serializers.ValidationError(
                {name: ["Cannot be changed; deploy a new pipeline (replicas: use scale)."] for name in fixed}
            )
        pipeline: Pipeline = self.context["pipeline"]
        if data.get("pinned_gpus"):
            sizes = list(pipeline.groups.values_list("gpus_per_replica", flat=True))
            _check_pins_hold_a_replica(data["pinned_gpus"], sizes)
        return data


def _check_pins_hold_a_replica(pinned_gpus: list[int], gpus_per_replica: list[int]) -> None:
    needed = max(gpus_per_replica, default=0)
    if pinned_gpus and len(pinned_gpus) < needed:
        raise serializers.ValidationError(
            {"placement": {"gpus": [f"{len(pinned_gpus)} pinned GPU(s) cannot hold a replica that needs {needed}."]}}
        )


class ScaleSerializer(serializers.Serializer):
    replicas = serializers.IntegerField(min_value=0, max_value=MAX_REPLICAS)
    role = serializers.ChoiceField(
        choices=WorkerGroup.Role.choices, required=False, help_text="Which group; needed when there are several."
    )


class AdapterLoadSerializer(serializers.Serializer):
    adapter = serializers.CharField(max_length=200, help_text="The name of one of the pipeline's model's adapters")


class PipelineAdaptersSerializer(serializers.Serializer):
    """A pipeline's loaded LoRA adapters, the generation of that set, and how many its engine holds."""

    pipeline = serializers.CharField(source="name", read_only=True)
    generation = serializers.IntegerField(source="adapter_generation", read_only=True)
    loaded = serializers.SerializerMethodField()
    max_loras = serializers.SerializerMethodField()

    def get_loaded(self, pipeline: Pipeline) -> list[dict[str, str]]:
        return [
            {"name": adapter.name, "source": adapter.source_display} for adapter in pipeline.adapters.order_by("name")
        ]

    def get_max_loras(self, pipeline: Pipeline) -> int | None:
        """None when its engine takes no adapters (or its engine args' limit is not a number)."""
        try:
            return pipeline_max_loras(pipeline)
        except Invalid:
            return None
