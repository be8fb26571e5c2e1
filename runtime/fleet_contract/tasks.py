"""The messages the control plane sends to node agents over Celery, shared by both sides.

The control plane never imports the agent and the agent never imports Django; they agree only on what is
here: task names, queue names and the payloads (msgspec structs, sent as JSON through Celery's ``json``
serializer: ``send_task(TASK_START_INSTANCE, args=[to_builtins(StartInstance(...))], queue=node_queue(n))``).

Every task is idempotent: starting an instance the agent already runs at the same ``attempt`` does nothing,
stopping one it does not run reports it stopped. ``attempt`` (the instance's restart count) lets an agent
ignore a start that a later restart has overtaken.

What becomes a process (StartInstance, its WorkerSpec and source) refuses a field it does not know
(``forbid_unknown_fields``): an agent that half-read a start would run something other than what was
asked, so it refuses the task and says which field (upgrade the agents before the control plane sends a
new one). A spec carries no environment: a worker's variables are the agent's allowlist
(agent/workers/spec.py), never a task's, which could otherwise name ``LD_PRELOAD``.

Each task names the node it is for (``node``: an agent refuses another node's) and carries the control
plane's ``signatures`` (runtime/fleet_contract/signing.py): an agent acts on no task its node's key did not sign.

The signature covers the whole payload, so also what makes a task single-use and short-lived
(``TaskStamp``): a ``nonce`` the agent remembers while the task is valid (a re-sent copy is ignored), and
when it was issued on the control plane's clock with how long it is valid. The agent judges that on the
control plane's clock too, as it estimates it from the ``Date`` of the control plane's answers, so a node
whose clock is off by minutes neither discards every task nor acts on old ones (Celery's own ``expires``
header, outside the signature and judged on the agent's clock alone, is not used).

An instance's ``incarnation`` is a random id the control plane gives the instance row when it makes it.
Instance ids are a database's counter: after a restore from an older backup, a new instance can have the
id of one whose worker still runs somewhere. A start, a stop and every report name the incarnation, and
an agent never takes a worker of one incarnation for another's.
"""

import re
import uuid
from typing import TypeVar

import msgspec

from runtime.cluster.addressing import EndpointAddress
from runtime.errors import ConfigError
from runtime.fleet_contract.router_settings import PipelineRouter

#: Start (download if need be, then launch) one instance's worker: one StartInstance argument.
TASK_START_INSTANCE = "flotilla.agent.start_instance"
#: Stop one instance's worker gracefully (drain, terminate, kill): one StopInstance argument.
TASK_STOP_INSTANCE = "flotilla.agent.stop_instance"
#: Make the LoRA adapters of one pipeline's workers on the node these (download, then write their --lora-file):
#: one SetAdapters argument. Idempotent: the control plane re-sends it on every reconciler pass.
TASK_SET_ADAPTERS = "flotilla.agent.set_adapters"
#: The last lines of one instance's worker log: one LogTailRequest argument; returns the text (a str). The
#: control plane waits for the result (Redis result backend) with a timeout: a node that does not answer
#: in time is reported as such, never waited on forever.
TASK_LOG_TAIL = "flotilla.agent.log_tail"
#: The queue of the control plane's own Celery worker (the reconciler's periodic task).
CONTROL_PLANE_QUEUE = "controlplane"
#: Slices of OpenAI batches' runs (controlplane/batches/): a queue of their own, so that a worker consuming
#: both keeps slots for the reconciler while batches run.
BATCHES_QUEUE = "controlplane.batches"

T = TypeVar("T")

#: A node's name is its queue's suffix and a label of its workers: a DNS label.
NODE_NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
#: NVML's GPU and MIG UUIDs ("GPU-8f1c…", "MIG-GPU-8f1c…/1/0") and the agent's simulated ones.
GPU_UUID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,95}$"
#: An instance's incarnation: 32 hex digits (a UUID4's), made by ``new_incarnation``.
INCARNATION_PATTERN = r"^[0-9a-f]{32}$"
_NODE_NAME = re.compile(NODE_NAME_PATTERN)


def new_incarnation() -> str:
    """A fresh incarnation id: random, so that no restored or second database can make it again."""
    return uuid.uuid4().hex


def node_queue(node: str) -> str:
    """The Celery queue of node ``node``'s agent. Raises ConfigError for a name a queue cannot carry."""
    if not _NODE_NAME.match(node):
        raise ConfigError(
            f"node name {node!r} is not usable: use 1-63 lowercase letters, digits or '-', "
            "starting and ending with a letter or digit"
        )
    return f"node.{node}"


class HubSource(msgspec.Struct, frozen=True, tag="hub", forbid_unknown_fields=True):
    """A Hugging Face repo at a revision (branch, tag or commit); ``file`` fetches only that file."""

    repo_id: str
    revision: str = "main"
    file: str | None = None


class LocalSource(msgspec.Struct, frozen=True, tag="local", forbid_unknown_fields=True):
    """A model folder or GGUF file already on the node."""

    path: str


ModelSource = HubSource | LocalSource


class AdapterSource(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A LoRA adapter a pipeline's workers load (runtime/lora.py): served as ``name``, its files from ``source``
    (fetched and checked as a model's are)."""

    name: str
    source: ModelSource


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One engine worker of an instance, as the control plane dispatches it."""

    instance_id: int
    pipeline: str  # the dyn:// namespace of the pipeline
    group: str  # the worker group's role: "aggregated", or "prefill"/"decode" (its worker's --disagg-role)
    replica: int
    engine: str  # out=<engine>
    model_path: str | None = None  # the local path the download gave; None for engines that need no model
    model_name: str | None = None  # the name clients use (--model-name)
    component: str = "backend"
    endpoint: str = "generate"
    engine_args: list[str] = []
    gpu_indexes: list[int] = []
    #: The UUIDs the control plane last heard for ``gpu_indexes``, in the same order; [] when it has none.
    #: The agent refuses the start when its GPUs at those indexes have other UUIDs (a GPU was swapped or the
    #: indexes moved), and names the GPUs to CUDA by UUID.
    gpu_uuids: list[str] = []
    #: Memory the worker declares on each of its GPUs: what a simulated GPU reports as used.
    gpu_memory_bytes: int = 0
    labels: dict[str, str] = {}
    #: The pipeline's router settings, passed to the worker as ``--router-*`` flags; None: the gateway's own.
    router: PipelineRouter | None = None
    #: The pipeline's LoRA adapters when the worker starts; later changes come as SetAdapters tasks.
    adapters: list[AdapterSource] = []
    #: The pipeline's adapter-set generation ``adapters`` is; 0: the pipeline never loaded an adapter, and its
    #: workers get no ``--lora-file`` (an engine such as vLLM reserves memory for adapters only when given one)
    #: unless their engine takes adapters at no cost (``LORA_AT_NO_COST_ENGINES``).
    adapter_generation: int = 0
    #: The pipeline's row id in the control plane: with ``pipeline`` (a namespace that a later pipeline may take
    #: again) it names the pipeline's adapter file on the node, so no pipeline reads an earlier one's. 0: not said.
    pipeline_id: int = 0
    #: The pipeline's adapter file on the node (agent/adapter_files.py), given to the worker as ``--lora-file``;
    #: the agent's to set, like ``model_path`` (a task naming one is refused).
    lora_file: str | None = None
    #: The llama.cpp multimodal projector on the node (``--mmproj``), fetched from StartInstance's ``projector``;
    #: the agent's to set, like ``model_path`` (a task naming one is refused).
    projector_path: str | None = None

    @property
    def address(self) -> EndpointAddress:
        """The worker's endpoint. Raises ConfigError for a pipeline, component or endpoint name it cannot use."""
        return EndpointAddress(self.pipeline, self.component, self.endpoint)


class TaskStamp(msgspec.Struct, frozen=True, kw_only=True):
    """What makes a signed task single-use and short-lived (the fields every task has; signed with it)."""

    #: A random id, new for every task sent: an agent ignores a second task with a nonce it has seen.
    nonce: str = ""
    #: When the control plane sent it (UNIX seconds, on its clock); 0: not said (then not checked).
    issued_at: float = 0.0
    #: How long after ``issued_at`` the task may still be acted on; a later pass sends a fresh one.
    valid_for_s: float = 0.0


class StartInstance(TaskStamp, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Run ``spec`` on the agent's node. ``source`` is fetched first and its local path becomes the spec's
    ``model_path``; None for engines that need no model files (``echo_full``). ``projector`` (llama.cpp's
    multimodal projector, a GGUF file) is fetched next and becomes its ``projector_path``."""

    spec: WorkerSpec
    source: ModelSource | None = None
    projector: ModelSource | None = None
    attempt: int = 0
    #: The instance row's random id ("" from a control plane that does not say): see the module's doc.
    incarnation: str = ""
    #: The node the start is for ("" from a control plane that does not say: refused).
    node: str = ""
    #: Key id -> HMAC-SHA256 of the task (runtime/fleet_contract/signing.py).
    signatures: dict[str, str] = {}


class StopInstance(TaskStamp, frozen=True, kw_only=True):
    """Stop instance ``instance_id``'s worker: SIGTERM (it drains), then SIGKILL after ``grace_s``.

    ``attempt`` and ``incarnation`` name the start it stops: an agent leaves alone a worker of a newer
    attempt or of another incarnation (None / "": not said, any worker of the instance is stopped)."""

    instance_id: int
    reason: str = ""
    grace_s: float = 30.0
    attempt: int | None = None
    incarnation: str = ""
    #: The node the stop is for ("" from a control plane that does not say: refused).
    node: str = ""
    signatures: dict[str, str] = {}


class SetAdapters(TaskStamp, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The LoRA adapters the workers of pipeline ``pipeline`` (its dyn:// namespace) on node ``node`` should have
    loaded now, as of the pipeline's ``generation`` of its set. The agent downloads each and writes the pipeline's
    adapter file (an ``AdapterSet``, runtime/lora.py), which its workers watch; a set older than the one the file
    holds is ignored."""

    pipeline: str
    #: The pipeline's row id (``WorkerSpec.pipeline_id``).
    pipeline_id: int = 0
    adapters: list[AdapterSource] = []
    generation: int
    node: str = ""
    signatures: dict[str, str] = {}


#: The most lines a log tail asks for (a result is one Redis value); the control plane refuses more, the
#: agent clips to it.
MAX_LOG_LINES = 10_000


class LogTailRequest(TaskStamp, frozen=True, kw_only=True):
    """The last ``lines`` lines of instance ``instance_id``'s worker log."""

    instance_id: int
    lines: int = 100
    signatures: dict[str, str] = {}


def decode_task_argument(value: object, kind: type[T]) -> T:
    """``value`` (a task's JSON argument) as ``kind``. Raises ConfigError naming what is wrong."""
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"malformed {kind.__name__} task argument: {exc}") from exc
