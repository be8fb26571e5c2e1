"""Pipelines (a served model name, its worker groups, its router settings and its placement policy), the
instances that run them on nodes, and the lease that keeps the reconciler's passes apart."""

import contextlib
import datetime
import re
from typing import ClassVar

from django.core.validators import RegexValidator
from django.db import IntegrityError, models, transaction
from django.db.models import Q
from django.db.models.functions import Lower

from controlplane.catalog.engines import Engine
from controlplane.deployments.instance_states import InstanceState
from controlplane.fleet.models import Node
from runtime.cluster.addressing import DEFAULT_COMPONENT, DEFAULT_ENDPOINT, SCHEME
from runtime.fleet_contract.router_settings import (
    DEFAULT_DISK_HIT_WEIGHT,
    DEFAULT_HOST_HIT_WEIGHT,
    DEFAULT_ISL_RATIO,
    DEFAULT_ISL_THRESHOLD,
    DEFAULT_PREFILL_BUSY,
    DEFAULT_QUEUED_PREFILL_WEIGHT,
)
from runtime.fleet_contract.tasks import new_incarnation

# What clients put in an OpenAI request's "model": "smol", "Qwen/Qwen3-0.6B", "llama-3.1-8b:instruct".
SERVED_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$"
validate_served_name = RegexValidator(
    re.compile(SERVED_NAME_PATTERN),
    "1-200 letters, digits or . _ : / @ + -, starting with a letter or digit",
)
# runtime.cluster.addressing's rule for one part of dyn://namespace.component.endpoint.
NAMESPACE_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
validate_namespace = RegexValidator(re.compile(NAMESPACE_PATTERN), "1-64 letters, digits, '-' or '_'")


class RouterMode(models.TextChoices):
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"
    KV = "kv"


class DisaggPolicy(models.TextChoices):
    """Where prompts are computed (runtime/fleet_contract/router_settings.py ``DISAGG_POLICIES``)."""

    ALWAYS = "always", "always on a prefill worker"
    ISL = "isl", "isl (on the decode worker when little is left to compute there)"
    LOAD = "load", "load (on the decode worker while the prefill workers are busy)"


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
    # What a prompt block found on a lower KV tier is worth to the kv router, against one on the device (0..1).
    kv_host_hit_weight = models.FloatField(default=DEFAULT_HOST_HIT_WEIGHT)
    kv_disk_hit_weight = models.FloatField(default=DEFAULT_DISK_HIT_WEIGHT)
    # Host memory each replica keeps as a KV tier below the device (kv_tiers.py turns it into the engine's
    # own setting; placement reserves it on the node); 0: no host tier.
    kv_host_cache_gib = models.FloatField(default=0.0)
    # Where prompts are computed when the pipeline has a prefill and a decode group (docs/disaggregation.md).
    disagg_policy = models.CharField(max_length=8, choices=DisaggPolicy.choices, default=DisaggPolicy.ALWAYS)
    disagg_isl_threshold = models.PositiveIntegerField(default=DEFAULT_ISL_THRESHOLD)
    disagg_isl_ratio = models.FloatField(default=DEFAULT_ISL_RATIO)  # 0..1
    disagg_prefill_busy = models.FloatField(default=DEFAULT_PREFILL_BUSY)  # > 0, engine steps
    disagg_decode_busy = models.FloatField(null=True, blank=True)  # 0..1 of the decode worker's KV; None: no gate
    placement_policy = models.CharField(max_length=8, choices=PlacementPolicy.choices, default=PlacementPolicy.SPREAD)
    pinned_nodes = models.JSONField(default=list, blank=True)  # node names; empty: any node
    pinned_gpus = models.JSONField(default=list, blank=True)  # GPU indexes; empty: any GPU
    # The planner's targets (planner/targets_json.py's document); None: the planner leaves this pipeline alone.
    planner = models.JSONField(null=True, blank=True)
    # The time to first token (p95, milliseconds) the pipeline should keep; above it an alert fires
    # (controlplane/alerts/). None: no target.
    ttft_target_ms = models.PositiveIntegerField(null=True, blank=True)
    # Counts changes of the router settings: workers register it with them, and a gateway takes a pool's
    # settings from the instance with the highest, so that an update reaches it without a restart.
    router_generation = models.PositiveIntegerField(default=1)
    # The LoRA adapters (of its model) its workers have loaded, each served under its own name
    # (deployments/adapters.py); ``adapter_generation`` counts the changes of that set, 0 while it never had
    # one (its workers then get no adapter file: runtime/fleet_contract/tasks.py's WorkerSpec).
    adapters = models.ManyToManyField("catalog.Adapter", blank=True, related_name="pipelines")
    adapter_generation = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering: ClassVar = ["name"]
        constraints: ClassVar = [
            # Served names that differ only in letter case are one name to a person typing it.
            models.UniqueConstraint(Lower("name"), name="pipeline_name_unique_ignoring_case"),
        ]

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


class Instance(models.Model):
    """One worker process of a pipeline's worker group: desired by an action, run by a node's agent.

    ::

                       (forward skips allowed)
        pending ──► downloading ──► starting ──► ready
           │             │              │          │
           │             └──────────────┴────┬─────┘
           │                                 ▼
           │                              stopping ──► stopped  (final)
           │                                 │
           │                                 └──► pending  (stopped to be restarted in place)
           └──► stopping, or stopped when it never started (nothing to stop)

        pending … stopping ──► failed (with a reason) ──► pending  (restart)
                                                    └──► stopped  (not wanted any more)

    The same moves as a list (a test holds it to ``TRANSITIONS``)::

        pending     → downloading, failed, ready, starting, stopped, stopping
        downloading → failed, ready, starting, stopping
        starting    → failed, ready, stopping
        ready       → failed, stopping
        stopping    → failed, pending, stopped
        failed      → pending, stopped
        stopped     → (final)

    ``pending`` with no node means "not placed yet" (``reason`` says why, when placement failed); the
    reconciler places it and dispatches it to the node's agent, which reports every later state.
    ``stopped`` is final. ``restart_requested`` turns the agent's "stopped" into ``pending`` again.

    ``dispatched_at`` is when the reconciler last sent the agent the task the current state needs (start
    for a placed pending instance, stop for a stopping one) and ``dispatches`` how often it did; every
    state change clears both. ``restarts`` counts every start after the first and is the ``attempt`` an
    agent sees and names in its reports. ``failure_streak`` counts the failures since the instance last
    ran well; it sets the restart backoff and the give-up point. ``gave_up`` marks a failed instance the
    reconciler no longer restarts: past its restarts, or failed for a reason retrying cannot fix (its
    node and GPUs are then let go).
    """

    State = InstanceState
    # The placement record is the decision's explanation, not desired state: kept out of every audit entry's
    # before and after (where it would repeat, a few KiB on a large fleet); the instance page shows it.
    audit_exclude: ClassVar[frozenset[str]] = frozenset({"placement"})

    pipeline = models.ForeignKey(Pipeline, on_delete=models.CASCADE, related_name="instances")
    group = models.ForeignKey(WorkerGroup, on_delete=models.CASCADE, related_name="instances")
    replica = models.PositiveIntegerField()  # ordinal within the group, never reused
    node = models.ForeignKey(Node, null=True, blank=True, on_delete=models.SET_NULL, related_name="instances")
    gpu_indexes = models.JSONField(default=list, blank=True)
    state = models.CharField(max_length=12, choices=InstanceState.choices, default=InstanceState.PENDING)
    reason = models.TextField(blank=True)
    pid = models.PositiveIntegerField(null=True, blank=True)
    endpoint_instance_id = models.BigIntegerField(null=True, blank=True)  # the worker's id in etcd (63 bits)
    # Random, made with the row: every task and report names it, so that after a database restore a new
    # instance that got an old one's id is never taken for it (runtime/fleet_contract/tasks.py).
    incarnation = models.CharField(max_length=32, default=new_incarnation, editable=False)
    restarts = models.PositiveIntegerField(default=0)
    # Starts of the same replica before this row took its place: a replacement (a restart beside itself, a
    # drain, a rolling update) or the start of a stopped pipeline makes a new row, but the replica has
    # restarted. The dashboard's Restarts column is ``replica_restarts``; ``restarts`` stays the agent's attempt.
    prior_restarts = models.PositiveIntegerField(default=0)
    restart_requested = models.BooleanField(default=False)
    failure_streak = models.PositiveIntegerField(default=0)
    # Failed for good: past max_restarts, or a failure retrying cannot fix. Only a person's restart revives it.
    gave_up = models.BooleanField(default=False)
    dispatched_at = models.DateTimeField(null=True, blank=True)
    dispatches = models.PositiveIntegerField(default=0)  # tasks sent for the current state, unanswered
    generation = models.PositiveIntegerField(default=1)  # its group's configuration when it was (re)started
    # The instance this one replaces (a drain, a restart that must not drop the only replica): that one is
    # stopped once this one is ready.
    replaces = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="replacements")
    # The replica's previous row, when this one took its place (a replacement, or the start of a stopped
    # pipeline): the chain its restart history is read from. Unlike ``replaces``, nothing waits on it.
    previous = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    download_progress = models.FloatField(null=True, blank=True)  # 0..1 while downloading
    # The last placement decision and why (controlplane/deployments/placement_record.py): the node and GPUs
    # chosen, each other node considered and why it was passed over; or why no node fits. {}: never tried.
    placement = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    state_changed_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        # The tables keep the names they had while the fleet app held these models (migration 0004 moved
        # them without touching the database).
        db_table = "fleet_instance"
        ordering: ClassVar = ["id"]
        indexes: ClassVar = [models.Index(fields=["state", "node"]), models.Index(fields=["group", "state"])]
        constraints: ClassVar = [
            models.UniqueConstraint(fields=["group", "replica"], name="unique_replica_per_group"),
            models.CheckConstraint(
                name="instance_state_is_known", condition=Q(state__in=[value for value, _ in InstanceState.choices])
            ),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def name(self) -> str:
        """``<pipeline namespace>-<role>-<replica>``: stable, readable, unique."""
        return f"{self.pipeline.namespace}-{self.group.role}-{self.replica}"

    @property
    def replica_restarts(self) -> int:
        """The restarts of the replica this instance runs: its own, and those of the rows it took over from."""
        return self.prior_restarts + self.restarts


class InstanceEvent(models.Model):
    """One line of an instance's timeline: a change of state, a dispatch, an agent's news, a restart.

    Written by ``controlplane/deployments/instance_events.py`` in the transaction of the change it records,
    which also keeps only the latest ``KEEP_EVENTS`` of an instance. ``before``/``after`` are states ("" when
    the event is not a change of state); ``data`` holds what a page lists apart (an exit code, a node).
    """

    class Kind(models.TextChoices):
        STATE = "state"
        PLACED = "placed"
        UNSCHEDULABLE = "unschedulable"
        DISPATCH = "dispatch"
        DOWNLOAD = "download"
        RESTART = "restart"

    instance = models.ForeignKey(Instance, on_delete=models.CASCADE, related_name="events")
    at = models.DateTimeField()
    kind = models.CharField(max_length=16, choices=Kind.choices)
    message = models.TextField(blank=True)
    before = models.CharField(max_length=12, blank=True)
    after = models.CharField(max_length=12, blank=True)
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering: ClassVar = ["instance_id", "at", "id"]
        indexes: ClassVar = [models.Index(fields=["instance", "at"])]

    def __str__(self) -> str:
        return f"{self.instance_id} {self.kind} at {self.at.isoformat()}: {self.message}"


class Lease(models.Model):
    """A named lease that one process at a time holds until ``expires_at``: the reconciler's pass lock.

    Taking it is one conditional update (free, expired, or ours already), so it works the same on SQLite
    and PostgreSQL and frees itself when its holder dies. ``rerun_requested`` is set by whoever found it
    taken, so that the holder runs once more instead of the request being lost. Not audited: it is
    coordination between processes, not desired state.
    """

    name = models.CharField(max_length=64, unique=True)
    holder = models.CharField(max_length=255, blank=True)
    expires_at = models.DateTimeField()
    rerun_requested = models.BooleanField(default=False)

    class Meta:
        db_table = "fleet_lease"
        ordering: ClassVar = ["name"]

    def __str__(self) -> str:
        return f"{self.name} held by {self.holder or 'nobody'} until {self.expires_at.isoformat()}"

    @classmethod
    def acquire(cls, name: str, holder: str, now: datetime.datetime, ttl: datetime.timedelta) -> bool:
        """Take (or renew) lease ``name`` for ``holder`` until ``now + ttl``. When another holds it, ask
        that holder to run once more and return False."""
        with contextlib.suppress(IntegrityError), transaction.atomic():
            cls.objects.get_or_create(name=name, defaults={"expires_at": now})
        for _ in range(2):
            free_or_ours = Q(expires_at__lte=now) | Q(holder=holder)
            if cls.objects.filter(free_or_ours, name=name).update(
                holder=holder, expires_at=now + ttl, rerun_requested=False
            ):
                return True
            # Still held: the flag is set only on a held lease, else its release may have crossed our try.
            if cls.objects.filter(name=name, expires_at__gt=now).exclude(holder=holder).update(rerun_requested=True):
                return False
        return False

    @classmethod
    def extend(cls, name: str, holder: str, now: datetime.datetime, ttl: datetime.timedelta) -> bool:
        """Renew ``holder``'s lease; False when it expired and someone else took it."""
        return bool(cls.objects.filter(name=name, holder=holder).update(expires_at=now + ttl))

    @classmethod
    def release(cls, name: str, holder: str, now: datetime.datetime) -> bool:
        """Let go of ``holder``'s lease, unless a rerun was asked for meanwhile: then the flag is cleared
        and False says "run again" (the lease is still held)."""
        if cls.objects.filter(name=name, holder=holder, rerun_requested=True).update(rerun_requested=False):
            return False
        cls.objects.filter(name=name, holder=holder, rerun_requested=False).update(holder="", expires_at=now)
        # Still ours only if a rerun request landed between the two updates.
        return not cls.objects.filter(name=name, holder=holder).exists()
