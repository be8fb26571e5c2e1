"""What node agents report to the control plane through its REST API (``/api/v1/agent/…``), shared by both sides.

The one definition of each report: the agent builds and sends these (agent/control_plane_client.py), the
control plane's serializers check a body against its limits and turn it into one of these
(``msgspec.convert``), and its actions take them (controlplane/fleet/actions.py,
controlplane/deployments/instances.py). The serializers say what a field may hold; that they have the
same fields, with the same defaults, is tested (tests/controlplane/test_agent_reports.py).

A field with a default is left out of the body when it has it (``omit_defaults``): the control plane reads
a missing field as that default, and a None as "not said" (the API refuses nulls where it can).
"""

import msgspec


class GpuReport(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One GPU of a node."""

    index: int
    name: str = ""
    #: NVML's UUID ("GPU-…", "MIG-…"): what a worker's CUDA_VISIBLE_DEVICES names; "" from agents that do not say.
    uuid: str = ""
    memory_total_bytes: int
    memory_used_bytes: int = 0
    utilization_percent: int = 0


class AdapterFailure(msgspec.Struct, frozen=True, kw_only=True):
    """A LoRA adapter the node could not fetch for a pipeline's workers (agent/adapter_files.py): left out of
    their adapter file, tried again with the next copy of the pipeline's set."""

    pipeline_id: int
    adapter: str
    reason: str


class NodeReport(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A node's inventory: sent at registration and with every heartbeat."""

    #: The node's name, which must be its token's; required at registration, "" (not said) in a heartbeat.
    name: str = ""
    address: str = ""
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    cpu_count: int = 0
    memory_total_bytes: int = 0
    memory_available_bytes: int = 0
    agent_version: str = ""
    gpus: list[GpuReport] = msgspec.field(default_factory=list)
    #: The machine the agent runs on (agent/machine_identity.py): the control plane refuses another
    #: machine's reports for this node. "" when the agent does not say.
    machine_id: str = ""
    #: The engines the node's workers can run (runtime.fleet_contract.engine_names.engines_on_this_node()), sorted: the
    #: control plane places a replica only on a node that reports its engine. None: not said (older agents),
    #: and the node keeps what it had.
    engines: list[str] | None = None
    #: Percent of all the node's CPUs' time that was busy since its previous report (0..100). None: not measured
    #: (the first report, a machine without /proc/stat, older agents); left out of the body then, so a control
    #: plane older than this field never sees it (its serializer would ignore it anyway).
    cpu_utilization_percent: float | None = None
    #: The adapters this node could not fetch for its pipelines' workers, as of now ([]: none). None: not said
    #: (older agents): the node keeps what it had.
    adapter_failures: list[AdapterFailure] | None = None


class InstanceReport(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """An agent's news about one instance: its state and what it knows about the process."""

    state: str
    reason: str = ""
    pid: int | None = None
    endpoint_instance_id: int | None = None
    download_progress: float | None = None
    #: The start this report is about (the instance's restart count when it was sent): the control plane
    #: refuses (409) a report of an older one. None: not said.
    attempt: int | None = None
    #: The instance's incarnation the report is about (runtime/fleet_contract/tasks.py): the control plane
    #: refuses (409) a report of another one. "": not said.
    incarnation: str = ""
    #: With "failed": retrying cannot fix it (exit code 2, a repository that does not exist); given up at once.
    permanent: bool = False


class DownloadReport(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A model download on a node: pending, downloading, done or failed (with ``error``).

    Sent with the model's id beside it (``{"model": id, ...}``): the model is the endpoint's key, not news.
    """

    state: str
    bytes_done: int = 0
    bytes_total: int | None = None
    error: str = ""
    #: With "done", for a llama.cpp model with a multimodal projector: the projector's size on disk, which a
    #: replica loads beside the weights (the catalog's memory estimate counts it). None: none, or not said.
    projector_bytes: int | None = None
