"""The fleet: nodes and their GPUs (as agents report them), the instances placed on them, and downloads."""

import contextlib
import datetime
import re
from typing import ClassVar

from django.core.validators import RegexValidator
from django.db import IntegrityError, models, transaction
from django.db.models import Q

from controlplane.errors import InvalidTransition
from runtime.fleet_tasks import NODE_NAME_PATTERN

# A node's name is also its Celery queue (node.<name>) and a label of its workers in etcd: a DNS label.
validate_node_name = RegexValidator(
    re.compile(NODE_NAME_PATTERN), "1-63 lowercase letters, digits or '-', starting and ending with a letter or digit"
)


class Node(models.Model):
    """A machine with an agent.

    ``state`` is liveness, which only the agent's heartbeats and the reconciler change::

        (register) ──► online ──(missed heartbeats)──► offline ──(heartbeat)──► online

    ``cordoned`` and ``draining`` are the operator's intent, kept apart from liveness so that a node that
    goes offline and comes back keeps them: nothing new is placed on a cordoned node (its instances stay),
    and a draining node is cordoned and has its instances replaced elsewhere, each stopped once its
    replacement is ready.
    """

    class State(models.TextChoices):
        ONLINE = "online"
        OFFLINE = "offline"

    name = models.CharField(max_length=63, unique=True, validators=[validate_node_name])
    address = models.CharField(max_length=255, blank=True)
    labels = models.JSONField(default=dict, blank=True)
    state = models.CharField(max_length=8, choices=State.choices, default=State.ONLINE, db_index=True)
    cordoned = models.BooleanField(default=False)
    draining = models.BooleanField(default=False)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    cpu_count = models.PositiveIntegerField(default=0)
    memory_total_bytes = models.BigIntegerField(default=0)
    memory_available_bytes = models.BigIntegerField(default=0)
    agent_version = models.CharField(max_length=64, blank=True)
    # The machine the node's agent runs on (controlplane/fleet/machines.py): blank until one is sent.
    machine_id = models.CharField(max_length=128, blank=True)
    registered_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering: ClassVar = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def schedulable(self) -> bool:
        return self.state == self.State.ONLINE and not self.draining and not self.cordoned


class Gpu(models.Model):
    """One GPU of a node, as its agent last reported it (NVML, or simulated with ``--gpus``)."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField()
    name = models.CharField(max_length=128, blank=True)
    #: NVML's UUID, which names the GPU to CUDA whatever the device order; "" when the agent did not say.
    uuid = models.CharField(max_length=96, blank=True, default="")
    memory_total_bytes = models.BigIntegerField()
    memory_used_bytes = models.BigIntegerField(default=0)
    utilization_percent = models.PositiveSmallIntegerField(default=0)

    class Meta:
        ordering: ClassVar = ["node_id", "index"]
        constraints: ClassVar = [models.UniqueConstraint(fields=["node", "index"], name="unique_gpu_index_per_node")]

    def __str__(self) -> str:
        return f"{self.node_id}:{self.index} {self.name}"


class InstanceState(models.TextChoices):
    PENDING = "pending"
    DOWNLOADING = "downloading"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


# The one place that says which state may follow which (drawn in Instance's docstring). Forward skips
# along the start path are allowed: an agent reports the latest state, and an earlier report may be lost.
TRANSITIONS: dict[str, frozenset[str]] = {
    InstanceState.PENDING: frozenset(
        {
            InstanceState.DOWNLOADING,
            InstanceState.STARTING,
            InstanceState.READY,
            InstanceState.STOPPING,
            InstanceState.STOPPED,
            InstanceState.FAILED,
        }
    ),
    InstanceState.DOWNLOADING: frozenset(
        {InstanceState.STARTING, InstanceState.READY, InstanceState.STOPPING, InstanceState.FAILED}
    ),
    InstanceState.STARTING: frozenset({InstanceState.READY, InstanceState.STOPPING, InstanceState.FAILED}),
    InstanceState.READY: frozenset({InstanceState.STOPPING, InstanceState.FAILED}),
    # stopping → pending: stopped in order to be restarted in place.
    InstanceState.STOPPING: frozenset({InstanceState.STOPPED, InstanceState.FAILED, InstanceState.PENDING}),
    InstanceState.FAILED: frozenset({InstanceState.PENDING, InstanceState.STOPPED}),
    InstanceState.STOPPED: frozenset(),
}
# States in which an instance counts towards its group's replicas (it runs, or is meant to run again).
LIVE_STATES = frozenset(
    {
        InstanceState.PENDING,
        InstanceState.DOWNLOADING,
        InstanceState.STARTING,
        InstanceState.READY,
        InstanceState.FAILED,
    }
)
# States in which a process may exist on the node, so stopping needs the agent.
PROCESS_STATES = frozenset(
    {InstanceState.DOWNLOADING, InstanceState.STARTING, InstanceState.READY, InstanceState.STOPPING}
)


def check_transition(current: str, new: str) -> None:
    """Raise InvalidTransition unless an instance in ``current`` may move to ``new``."""
    if new not in TRANSITIONS[current]:
        allowed = ", ".join(sorted(TRANSITIONS[current])) or "none (it is final)"
        raise InvalidTransition(f"an instance cannot go from {current} to {new} (from {current}: {allowed})")


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

    pipeline = models.ForeignKey("deployments.Pipeline", on_delete=models.CASCADE, related_name="instances")
    group = models.ForeignKey("deployments.WorkerGroup", on_delete=models.CASCADE, related_name="instances")
    replica = models.PositiveIntegerField()  # ordinal within the group, never reused
    node = models.ForeignKey(Node, null=True, blank=True, on_delete=models.SET_NULL, related_name="instances")
    gpu_indexes = models.JSONField(default=list, blank=True)
    state = models.CharField(max_length=12, choices=InstanceState.choices, default=InstanceState.PENDING)
    reason = models.TextField(blank=True)
    pid = models.PositiveIntegerField(null=True, blank=True)
    endpoint_instance_id = models.BigIntegerField(null=True, blank=True)  # the worker's id in etcd (63 bits)
    restarts = models.PositiveIntegerField(default=0)
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
    download_progress = models.FloatField(null=True, blank=True)  # 0..1 while downloading
    created_at = models.DateTimeField(auto_now_add=True)
    state_changed_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
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


class Download(models.Model):
    """A model's files on one node, as that node's agent reports them."""

    class State(models.TextChoices):
        PENDING = "pending"
        DOWNLOADING = "downloading"
        DONE = "done"
        FAILED = "failed"

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="downloads")
    model = models.ForeignKey("catalog.LanguageModel", on_delete=models.CASCADE, related_name="downloads")
    state = models.CharField(max_length=12, choices=State.choices, default=State.PENDING)
    bytes_done = models.BigIntegerField(default=0)
    bytes_total = models.BigIntegerField(null=True, blank=True)
    error = models.TextField(blank=True)
    started_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering: ClassVar = ["node_id", "model_id"]
        constraints: ClassVar = [models.UniqueConstraint(fields=["node", "model"], name="unique_download_per_node")]

    def __str__(self) -> str:
        return f"{self.model_id} on {self.node_id}: {self.state}"

    @property
    def progress(self) -> float | None:
        if not self.bytes_total:
            return None
        return min(1.0, self.bytes_done / self.bytes_total)


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
