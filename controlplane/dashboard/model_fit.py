"""Where a model would fit in the fleet, per engine that can serve it: a pure decision over the inventory.

The memory need is catalog/memory.py's estimate (weights × 1.2 + one full-context sequence's KV), the same for
every engine that loads the weights; what differs between engines is where they run (vLLM, SGLang and
TensorRT-LLM on GPUs only, llama.cpp and mistral.rs on GPUs or on a node's CPUs and memory) and which nodes run
them. The answer is placement's own (deployments/placement.py's ``place`` on the same inventory it uses): the
single GPUs with room for a replica, else the fewest GPUs of one node that hold it split evenly, and for
engines that may run on CPU the nodes with enough free system memory; when it fits nowhere, placement's
reason ("needs 1 GPU with 30 GiB free; the best node, gpu-a, has 0 (its GPU with the most free memory has 20
GiB)").
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

from controlplane.catalog.engines import WEIGHTLESS_ENGINES
from controlplane.deployments.placement import Demand, NodeInventory, Placement, format_bytes, place
from runtime.fleet_contract.engine_names import (
    ENGINE_LABELS,
    ENGINES_WITHOUT_FILES,
    GGUF_ONLY_ENGINES,
    GPU_ONLY_ENGINES,
)

#: Engines that load a GGUF file: llama.cpp, and mistral.rs (engines/mistralrs.py: GGUF files or safetensors).
GGUF_LOADERS = GGUF_ONLY_ENGINES | {"mistralrs"}
# Engines that load no weights: an estimate from the weights says nothing of them.
_WEIGHTLESS = WEIGHTLESS_ENGINES | ENGINES_WITHOUT_FILES
#: Tensor-parallel sizes tried when a replica does not fit one GPU.
GPU_COUNTS = (1, 2, 4, 8)
#: How many GPUs (or nodes) a row names.
MAX_LISTED = 8


@dataclass(frozen=True, slots=True)
class EngineFit:
    """Where one replica of the model fits when ``engine`` serves it.

    ``gpus`` are the single GPUs with room ("gpu-a GPU 0: 70 GiB free"); when there is none, ``multi_gpu``
    names the fewest GPUs of one node that hold it ("2 GPUs of gpu-b (0, 1)"). ``nodes`` are the nodes with
    the system memory to run it on CPU (engines that may). ``problem`` says why it fits nowhere ("" if it fits).
    """

    engine: str
    label: str
    memory_bytes: int | None
    gpus: list[str] = field(default_factory=list)
    multi_gpu: str = ""
    nodes: list[str] = field(default_factory=list)
    problem: str = ""

    @property
    def fits(self) -> bool:
        return bool(self.gpus or self.multi_gpu or self.nodes)

    @property
    def runs_on_cpu(self) -> bool:
        return self.engine not in GPU_ONLY_ENGINES


def serving_engines(is_gguf: bool) -> list[str]:
    """The engines that can serve a GGUF file (``is_gguf``) or a safetensors folder, in the dashboard's order."""
    return [
        engine
        for engine in ENGINE_LABELS
        if engine not in _WEIGHTLESS and (engine in GGUF_LOADERS if is_gguf else engine not in GGUF_ONLY_ENGINES)
    ]


def engine_fits(
    memory_bytes: int | None, engines: Sequence[str], inventory: Sequence[NodeInventory]
) -> list[EngineFit]:
    """Where one replica needing ``memory_bytes`` (None: unknown, no answer) fits, for each of ``engines``."""
    return [_fit(engine, memory_bytes, inventory) for engine in engines]


def _fit(engine: str, need: int | None, inventory: Sequence[NodeInventory]) -> EngineFit:
    label = ENGINE_LABELS.get(engine, engine)
    if need is None:
        return EngineFit(engine, label, None, problem="no estimate: the size of its weights is unknown")
    usable = [node for node in inventory if node.schedulable and node.runs(engine)]
    gpus = [
        f"{node.name} GPU {gpu.index}: {format_bytes(max(0, gpu.memory_free_bytes))} free"
        for node in usable
        for gpu in node.gpus
        if gpu.memory_free_bytes >= need
    ]
    multi_gpu = "" if gpus else _fewest_gpus(engine, need, inventory)
    on_cpu = engine not in GPU_ONLY_ENGINES
    nodes = [
        f"{node.name}: {format_bytes(max(0, node.memory_free_bytes))} free"
        for node in usable
        if on_cpu and node.memory_free_bytes >= need
    ]
    fit = EngineFit(engine, label, need, gpus=_first(gpus), multi_gpu=multi_gpu, nodes=_first(nodes))
    if fit.fits:
        return fit
    reasons = [f"on GPUs: {_reason(Demand(1, 1, need, engine=engine), inventory)}"]
    if on_cpu:
        reasons.append(f"on CPU: {_reason(Demand(1, 0, need, engine=engine), inventory)}")
    return EngineFit(engine, label, need, problem="; ".join(reasons))


def _first(places: list[str]) -> list[str]:
    """At most ``MAX_LISTED`` places, then how many more: a fleet of hundreds of GPUs is not listed whole."""
    if len(places) <= MAX_LISTED:
        return places
    return [*places[:MAX_LISTED], f"and {len(places) - MAX_LISTED} more"]


def _fewest_gpus(engine: str, need: int, inventory: Sequence[NodeInventory]) -> str:
    for count in GPU_COUNTS[1:]:
        answer = place(Demand(1, count, need, engine=engine), inventory)
        if isinstance(answer, Placement):
            (replica,) = answer.replicas
            indexes = ", ".join(str(index) for index in replica.gpu_indexes)
            return f"{count} GPUs of {replica.node} ({indexes}), {format_bytes(-(-need // count))} each"
    return ""


def _reason(demand: Demand, inventory: Sequence[NodeInventory]) -> str:
    answer = place(demand, inventory)
    return "" if isinstance(answer, Placement) else answer.reason
