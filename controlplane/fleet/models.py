"""The fleet: nodes and their GPUs, as their agents report them, and the downloads of models onto them.

What runs on the nodes (instances) is the deployments app's (controlplane/deployments/models.py)."""

import re
from typing import ClassVar

from django.core.validators import RegexValidator
from django.db import models

from runtime.fleet_contract.tasks import NODE_NAME_PATTERN

# A node's name is also its Celery queue (node.<name>) and a label of its workers in etcd: a DNS label.
validate_node_name = RegexValidator(
    re.compile(NODE_NAME_PATTERN), "1-63 lowercase letters, digits or '-', starting and ending with a letter or digit"
)

#: What a node is taken to run until its agent reports its engines (agents older than these reports never do):
#: the engines those agents implemented. Taking them keeps a fleet placing what it placed before when the
#: control plane is upgraded ahead of its agents; an older agent that lacks one (llama.cpp or mistral.rs not
#: installed) refuses its task with a clear reason, as before. Frozen, not IMPLEMENTED_ENGINES: an engine added
#: later is one no older agent runs. The first report of an agent that says replaces it.
ENGINES_BEFORE_REPORTS = ("echo_core", "echo_full", "llamacpp", "mistralrs", "mocker")


def engines_before_reports() -> list[str]:
    """A new ``Node.engines``: a fresh list each time (a JSONField's default must not be shared)."""
    return list(ENGINES_BEFORE_REPORTS)


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
    # Silence is counted from the later of the last heartbeat and this: the reconciler moves it to now while
    # it cannot judge silence (its own absence, a disruption that holds evictions), so that a node is
    # evicted only after a whole eviction time of silence the control plane itself witnessed.
    silence_counted_from = models.DateTimeField(null=True, blank=True)
    # When the reconciler last evicted it (its instances failed to be placed elsewhere): evictions are rate-limited.
    evicted_at = models.DateTimeField(null=True, blank=True)
    cpu_count = models.PositiveIntegerField(default=0)
    memory_total_bytes = models.BigIntegerField(default=0)
    memory_available_bytes = models.BigIntegerField(default=0)
    # Percent of all its CPUs' time busy between its agent's last two reports, 0..100; None: not reported.
    cpu_utilization_percent = models.FloatField(null=True, blank=True)
    agent_version = models.CharField(max_length=64, blank=True)
    # The machine the node's agent runs on (controlplane/fleet/machines.py): blank until one is sent.
    machine_id = models.CharField(max_length=128, blank=True)
    # The engines its agent says it can run (runtime.fleet_contract.engine_names.engines_on_this_node()), sorted;
    # placement puts a replica only where its engine is. Until the agent says: ENGINES_BEFORE_REPORTS (see there why).
    engines = models.JSONField(default=engines_before_reports, blank=True)
    # The LoRA adapters its agent could not fetch for its pipelines' workers, as its last heartbeat said:
    # [{"pipeline_id", "adapter", "reason"}], only for pipelines with an instance placed here (the Adapters panel).
    adapter_failures = models.JSONField(default=list, blank=True)
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
