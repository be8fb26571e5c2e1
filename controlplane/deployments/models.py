"""Pipelines: a served model name, its worker groups, its router settings and its placement policy."""

import re
from typing import ClassVar

from django.core.validators import RegexValidator
from django.db import models

from controlplane.catalog.engines import Engine
from runtime.addressing import DEFAULT_COMPONENT, DEFAULT_ENDPOINT, SCHEME
from runtime.fleet_tasks import DEFAULT_QUEUED_PREFILL_WEIGHT

# What clients put in an OpenAI request's "model": "smol", "Qwen/Qwen3-0.6B", "llama-3.1-8b:instruct".
SERVED_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$"
validate_served_name = RegexValidator(
    re.compile(SERVED_NAME_PATTERN),
    "1-200 letters, digits or . _ : / @ + -, starting with a letter or digit",
)
# runtime.addressing's rule for one part of dyn://namespace.component.endpoint.
NAMESPACE_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
validate_namespace = RegexValidator(re.compile(NAMESPACE_PATTERN), "1-64 letters, digits, '-' or '_'")


class RouterMode(models.TextChoices):
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"
    KV = "kv"


class PlacementPolicy(models.TextChoices):
    SPREAD = "spread", "spread (replicas on different nodes and GPUs)"
    BINPACK = "binpack", "binpack (fill the busiest node that fits first)"


class Pipeline(models.Model):
    """A deployed model: one served model name, its own ``dyn://`` namespace, one or more worker groups.

    ``state`` is desired state, changed only by the operator's actions::

        running ──(stop)──► stopped ──(start)──► running

    Router settings reach the gateway through the workers' registration in etcd (the serving path), so the
    gateway never asks the control plane. Pins restrict placement to the named nodes and GPU indexes.
    """

    class State(models.TextChoices):
        RUNNING = "running"
        STOPPED = "stopped"

    name = models.CharField(max_length=200, unique=True, validators=[validate_served_name])
    namespace = models.CharField(max_length=64, unique=True, validators=[validate_namespace])
    model = models.ForeignKey("catalog.LanguageModel", on_delete=models.PROTECT, related_name="pipelines")
    state = models.CharField(max_length=8, choices=State.choices, default=State.RUNNING)
    router_mode = models.CharField(max_length=16, choices=RouterMode.choices, default=RouterMode.ROUND_ROBIN)
    kv_overlap_score_weight = models.FloatField(default=1.0)
    kv_queued_prefill_weight = models.FloatField(default=DEFAULT_QUEUED_PREFILL_WEIGHT)  # 0..1
    router_temperature = models.FloatField(default=0.0)
    use_kv_events = models.BooleanField(default=True)
    placement_policy = models.CharField(max_length=8, choices=PlacementPolicy.choices, default=PlacementPolicy.SPREAD)
    pinned_nodes = models.JSONField(default=list, blank=True)  # node names; empty: any node
    pinned_gpus = models.JSONField(default=list, blank=True)  # GPU indexes; empty: any GPU
    # Counts changes of the router settings: workers register it with them, and a gateway takes a pool's
    # settings from the instance with the highest, so that an update reaches it without a restart.
    router_generation = models.PositiveIntegerField(default=1)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering: ClassVar = ["name"]

    def __str__(self) -> str:
        return self.name


class WorkerGroup(models.Model):
    """Replicas of one role in a pipeline, each running ``engine`` on ``gpus_per_replica`` GPUs of one node.

    ``aggregated`` workers do prefill and decode; ``prefill``/``decode`` are for disaggregated serving
    (a pipeline has either one aggregated group or one of each). ``gpus_per_replica`` is the tensor-parallel
    size; 0 runs on CPU (mocker, llama.cpp, echo). ``engine_args`` are laid over the model's defaults.
    ``generation`` counts the changes its workers must restart for (a rolling update replaces the rest).
    """

    class Role(models.TextChoices):
        AGGREGATED = "aggregated"
        PREFILL = "prefill"
        DECODE = "decode"

    pipeline = models.ForeignKey(Pipeline, on_delete=models.CASCADE, related_name="groups")
    role = models.CharField(max_length=12, choices=Role.choices, default=Role.AGGREGATED)
    engine = models.CharField(max_length=16, choices=Engine.choices)
    replicas = models.PositiveIntegerField(default=1)
    gpus_per_replica = models.PositiveSmallIntegerField(default=0)
    engine_args = models.JSONField(default=dict, blank=True)
    next_replica = models.PositiveIntegerField(default=0)  # the ordinal the next new instance gets
    # The group's configuration version: bumped by each change its workers must restart for (engine args,
    # GPUs, router settings). Each instance records the one it was started with; the reconciler replaces
    # outdated ones one at a time, the new one ready before the old one stops.
    generation = models.PositiveIntegerField(default=1)

    class Meta:
        ordering: ClassVar = ["pipeline_id", "role"]
        constraints: ClassVar = [models.UniqueConstraint(fields=["pipeline", "role"], name="unique_role_per_pipeline")]

    def __str__(self) -> str:
        return f"{self.pipeline_id}/{self.role}"

    @property
    def component(self) -> str:
        """The component of this group's workers in ``dyn://namespace.component.endpoint``."""
        return DEFAULT_COMPONENT if self.role == self.Role.AGGREGATED else self.role

    @property
    def endpoint(self) -> str:
        return f"{SCHEME}{self.pipeline.namespace}.{self.component}.{DEFAULT_ENDPOINT}"
