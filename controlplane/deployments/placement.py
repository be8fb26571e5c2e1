"""Where new replicas of a worker group go: a pure decision over plain data, no database inside.

``place(demand, inventory)`` returns a ``Placement`` (one node and its GPU indexes per replica) or an
``Unschedulable`` whose reason a person can act on ("needs 2 GPUs with 20 GiB free each; the best node,
gpu-a, has 1"), with the replicas that did fit, so a caller may start those and keep the rest pending.

Rules:
* A replica's GPUs are all on one node (tensor parallelism does not cross machines).
* A GPU fits when its free memory covers the replica's memory need divided evenly over its GPUs. When
  the need is unknown, a replica takes GPUs no instance uses yet (whole GPUs to itself).
* GPUs may be shared by replicas (of any pipeline) as long as memory lasts.
* ``spread`` puts each replica on the node with the fewest replicas of its group, then the fewest
  instances, then the most free memory; on a node it takes the emptiest GPUs.
  ``binpack`` fills the node with the least free memory that still fits; on a node it takes the GPUs
  with the least free memory that still fit (best fit), keeping whole GPUs free for big replicas.
* Replicas that need no GPU (mocker, llama.cpp, echo on CPU) are placed by node only: a node fits when
  its free system memory covers the need (any node, when the need is unknown); both policies prefer
  nodes without GPUs, ``spread`` only after spreading over nodes, so that GPUs stay free for GPU work.
* A replica with a host KV tier also needs that much free system memory on its node, GPU replicas too;
  a CPU replica needs its model's memory and its tier together.
* Only schedulable nodes (online, neither draining nor cordoned) are used; pins restrict nodes and GPU indexes.
* A replica goes only to a node that runs its engine (as the node's agent reports); when no node does, the
  reason says how to get one ("no node runs vllm: install it with pip install 'flotilla[vllm]' on a node").
"""

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from controlplane.catalog.engines import install_hint

Policy = Literal["spread", "binpack"]
_ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth")
_MAX_NAMED = 5


@dataclass(frozen=True, slots=True)
class GpuInventory:
    """One GPU: ``memory_free_bytes`` is after both what it reports used and what placed instances reserve."""

    index: int
    memory_total_bytes: int
    memory_free_bytes: int
    instances: int = 0
    name: str = ""


@dataclass(frozen=True, slots=True)
class NodeInventory:
    """One node as placement sees it; ``unschedulable_because`` is "offline", "draining", "cordoned" or "".

    ``engines`` are those its agent reports it can run; None: any (callers that do not say).
    """

    name: str
    gpus: tuple[GpuInventory, ...] = ()
    memory_free_bytes: int = 0
    instances: int = 0
    unschedulable_because: str = ""
    engines: frozenset[str] | None = None

    @property
    def schedulable(self) -> bool:
        return not self.unschedulable_because

    def runs(self, engine: str) -> bool:
        return not engine or self.engines is None or engine in self.engines


@dataclass(frozen=True, slots=True)
class Demand:
    """New replicas wanted for one worker group.

    ``memory_per_replica_bytes`` is None when unknown. ``existing_replicas_by_node`` counts the group's
    replicas already placed, so that ``spread`` keeps spreading across calls. ``engine`` is the group's
    (the nodes that do not run it are passed over); "" places on any node. ``host_memory_per_replica_bytes``
    is the system memory each replica keeps as a KV tier (0: none), on top of its model's memory.
    """

    replicas: int
    gpus_per_replica: int
    memory_per_replica_bytes: int | None
    policy: Policy = "spread"
    pinned_nodes: frozenset[str] = frozenset()
    pinned_gpus: frozenset[int] = frozenset()
    existing_replicas_by_node: Mapping[str, int] = field(default_factory=dict)
    engine: str = ""
    host_memory_per_replica_bytes: int = 0

    @property
    def node_memory_bytes(self) -> int | None:
        """What each replica takes of its node's system memory: its host tier, and on CPU its model too;
        None when that is unknown (a CPU replica whose model's need is unknown, with no host tier)."""
        host = self.host_memory_per_replica_bytes
        if self.gpus_per_replica == 0 and self.memory_per_replica_bytes is not None:
            return self.memory_per_replica_bytes + host
        return host or None

    @property
    def memory_per_gpu_bytes(self) -> int | None:
        if self.memory_per_replica_bytes is None or self.gpus_per_replica == 0:
            return self.memory_per_replica_bytes
        return math.ceil(self.memory_per_replica_bytes / self.gpus_per_replica)


@dataclass(frozen=True, slots=True)
class ReplicaPlacement:
    node: str
    gpu_indexes: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Placement:
    replicas: tuple[ReplicaPlacement, ...]


@dataclass(frozen=True, slots=True)
class Unschedulable:
    """Not every replica fits: why (for a person), and the ones that did fit (possibly none)."""

    reason: str
    placed: tuple[ReplicaPlacement, ...] = ()


def place(demand: Demand, inventory: Iterable[NodeInventory]) -> Placement | Unschedulable:
    """Place ``demand.replicas`` new replicas on ``inventory`` (see the module docstring for the rules).

    Raises ValueError for a demand that makes no sense (negative counts); everything the fleet cannot
    satisfy is an ``Unschedulable`` instead.
    """
    if demand.replicas < 0 or demand.gpus_per_replica < 0:
        raise ValueError(f"replicas and GPUs per replica must be ≥ 0, not {demand.replicas}, {demand.gpus_per_replica}")
    if demand.memory_per_replica_bytes is not None and demand.memory_per_replica_bytes < 0:
        raise ValueError("memory per replica must be ≥ 0")
    if demand.host_memory_per_replica_bytes < 0:
        raise ValueError("host memory per replica must be ≥ 0")
    if demand.replicas == 0:
        return Placement(())
    nodes = list(inventory)
    problem = _impossible(demand, nodes)
    if problem:
        return Unschedulable(problem)
    candidates = [_WorkingNode.of(node, demand) for node in nodes if _allowed(node, demand)]
    placed: list[ReplicaPlacement] = []
    for _ in range(demand.replicas):
        chosen = _choose(demand, candidates)
        if chosen is None:
            return Unschedulable(_explain(demand, candidates, len(placed)), tuple(placed))
        node, gpu_indexes = chosen
        node.take(demand, gpu_indexes)
        placed.append(ReplicaPlacement(node.name, gpu_indexes))
    return Placement(tuple(placed))


def format_bytes(size: int) -> str:
    """``20 GiB``, ``1.5 GiB``, ``512 MiB``: sizes as people read them."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            value = round(size / scale, 1)
            return f"{value:g} {unit}"
    return f"{size} bytes"


class _WorkingNode:
    """A node's free resources while replicas are being placed on it (the inventory itself is frozen)."""

    def __init__(self, node: NodeInventory, eligible_gpus: list[GpuInventory], group_replicas: int) -> None:
        self.name = node.name
        self.gpu_count = len(node.gpus)
        self.gpus = {gpu.index: [gpu.memory_free_bytes, gpu.instances] for gpu in eligible_gpus}
        self.memory_free = node.memory_free_bytes
        self.instances = node.instances
        self.group_replicas = group_replicas

    @classmethod
    def of(cls, node: NodeInventory, demand: Demand) -> "_WorkingNode":
        eligible = [gpu for gpu in node.gpus if not demand.pinned_gpus or gpu.index in demand.pinned_gpus]
        return cls(node, eligible, demand.existing_replicas_by_node.get(node.name, 0))

    def fitting_gpus(self, demand: Demand) -> list[int]:
        need = demand.memory_per_gpu_bytes
        if need is None:
            return [index for index, (_, instances) in self.gpus.items() if instances == 0]
        return [index for index, (free, _) in self.gpus.items() if free >= need]

    def free_memory_of(self, indexes: Iterable[int]) -> int:
        return sum(max(0, self.gpus[index][0]) for index in indexes)

    def take(self, demand: Demand, gpu_indexes: tuple[int, ...]) -> None:
        need = demand.memory_per_gpu_bytes or 0
        for index in gpu_indexes:
            self.gpus[index][0] -= need
            self.gpus[index][1] += 1
        self.memory_free -= demand.node_memory_bytes or 0
        self.instances += 1
        self.group_replicas += 1


def _allowed(node: NodeInventory, demand: Demand) -> bool:
    pinned_here = not demand.pinned_nodes or node.name in demand.pinned_nodes
    return node.schedulable and pinned_here and node.runs(demand.engine)


def _impossible(demand: Demand, nodes: list[NodeInventory]) -> str:
    """Why no replica can be placed whatever the free memory, or "" when that is not the case."""
    if demand.pinned_gpus and len(demand.pinned_gpus) < demand.gpus_per_replica:
        return (
            f"pinned to {_plural(len(demand.pinned_gpus), 'GPU')} ({_indexes(demand.pinned_gpus)}) "
            f"but each replica needs {demand.gpus_per_replica}"
        )
    if not nodes:
        return "no node is registered: start an agent (flotilla agent) on a machine"
    names = {node.name for node in nodes}
    missing = sorted(demand.pinned_nodes - names)
    if demand.pinned_nodes and len(missing) == len(demand.pinned_nodes):
        return f"pinned to {_names(missing)}, which {'is' if len(missing) == 1 else 'are'} not registered"
    considered = [node for node in nodes if not demand.pinned_nodes or node.name in demand.pinned_nodes]
    running = [node for node in considered if node.runs(demand.engine)]
    if not running:
        where = f"no node it is pinned to ({_names(sorted(demand.pinned_nodes))})" if demand.pinned_nodes else "no node"
        return f"{where} runs {demand.engine}: {install_hint(demand.engine)}"
    considered = running
    if not any(node.schedulable for node in considered):
        why = ", ".join(f"{node.name} is {node.unschedulable_because}" for node in considered[:_MAX_NAMED])
        more = f" and {len(considered) - _MAX_NAMED} more" if len(considered) > _MAX_NAMED else ""
        return f"no node can take new instances: {why}{more}"
    return ""


def _choose(demand: Demand, nodes: list[_WorkingNode]) -> tuple[_WorkingNode, tuple[int, ...]] | None:
    if demand.gpus_per_replica == 0:
        return _choose_cpu(demand, nodes)
    best: tuple[tuple[object, ...], _WorkingNode, tuple[int, ...]] | None = None
    for node in nodes:
        if not _holds_host_tier(demand, node):
            continue
        fitting = node.fitting_gpus(demand)
        if len(fitting) < demand.gpus_per_replica:
            continue
        gpus = _pick_gpus(demand, node, fitting)
        if demand.policy == "spread":
            key: tuple[object, ...] = (node.group_replicas, node.instances, -node.free_memory_of(gpus), node.name)
        else:
            key = (node.free_memory_of(node.gpus), node.name)
        if best is None or key < best[0]:
            best = (key, node, gpus)
    return None if best is None else (best[1], best[2])


def _pick_gpus(demand: Demand, node: _WorkingNode, fitting: list[int]) -> tuple[int, ...]:
    if demand.policy == "spread":
        ranked = sorted(fitting, key=lambda index: (node.gpus[index][1], -node.gpus[index][0], index))
    else:
        ranked = sorted(fitting, key=lambda index: (node.gpus[index][0], index))
    return tuple(sorted(ranked[: demand.gpus_per_replica]))


def _holds_host_tier(demand: Demand, node: _WorkingNode) -> bool:
    return node.memory_free >= demand.host_memory_per_replica_bytes


def _choose_cpu(demand: Demand, nodes: list[_WorkingNode]) -> tuple[_WorkingNode, tuple[int, ...]] | None:
    need = demand.node_memory_bytes
    fitting = [node for node in nodes if need is None or node.memory_free >= need]
    if not fitting:
        return None
    if demand.policy == "spread":
        chosen = min(
            fitting,
            key=lambda node: (node.group_replicas, node.instances, node.gpu_count, -node.memory_free, node.name),
        )
    else:
        chosen = min(fitting, key=lambda node: (node.gpu_count, node.memory_free, node.name))
    return chosen, ()


def _explain(demand: Demand, nodes: list[_WorkingNode], placed: int) -> str:
    """Why the next replica does not fit, naming the node that came closest."""
    what = _need(demand)
    if demand.gpus_per_replica == 0:
        best_cpu = min(nodes, key=lambda node: (-node.memory_free, node.name))
        detail = f"the best node, {best_cpu.name}, has {format_bytes(max(0, best_cpu.memory_free))} free"
    elif not any(node.gpus for node in nodes):
        pinned = f" among GPUs {_indexes(demand.pinned_gpus)}" if demand.pinned_gpus else ""
        detail = f"no node that can take new instances has a GPU{pinned}"
    elif gpus_fit := [node for node in nodes if len(node.fitting_gpus(demand)) >= demand.gpus_per_replica]:
        # The GPUs are there: it is the host tier's memory that is not.
        best_host = min(gpus_fit, key=lambda node: (-node.memory_free, node.name))
        detail = (
            f"the best node with the GPUs, {best_host.name}, has {format_bytes(max(0, best_host.memory_free))} "
            "of system memory free"
        )
    else:
        best = min(nodes, key=lambda node: (-len(node.fitting_gpus(demand)), -_most_free(node), node.name))
        detail = f"the best node, {best.name}, has {len(best.fitting_gpus(demand))}"
        if not best.fitting_gpus(demand) and demand.memory_per_gpu_bytes is not None:
            detail += f" (its GPU with the most free memory has {format_bytes(_most_free(best))})"
    if placed == 0:
        return f"needs {what}; {detail}"
    ordinal = _ORDINALS[placed] if placed < len(_ORDINALS) else f"#{placed + 1}"
    return f"only {placed} of {demand.replicas} replicas fit; the {ordinal} needs {what}; {detail}"


def _need(demand: Demand) -> str:
    count = demand.gpus_per_replica
    pinned = f" among GPUs {_indexes(demand.pinned_gpus)}" if demand.pinned_gpus else ""
    host = demand.host_memory_per_replica_bytes
    tier = f" ({format_bytes(host)} of it for its host KV tier)" if host else ""
    if count == 0:
        need = demand.node_memory_bytes
        return "a node" if need is None else f"a node with {format_bytes(need)} of free memory{tier}"
    per_gpu = demand.memory_per_gpu_bytes
    on_host = f" and {format_bytes(host)} of free system memory for its host KV tier" if host else ""
    if per_gpu is None:
        return f"{_plural(count, 'unused GPU')}{pinned} (its memory need is unknown){on_host}"
    each = " each" if count > 1 else ""
    return f"{_plural(count, 'GPU')}{pinned} with {format_bytes(per_gpu)} free{each}{on_host}"


def _most_free(node: _WorkingNode) -> int:
    return max((max(0, free) for free, _ in node.gpus.values()), default=0)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _indexes(indexes: Iterable[int]) -> str:
    return ", ".join(str(index) for index in sorted(indexes))


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMED])
    return shown if len(names) <= _MAX_NAMED else f"{shown} and {len(names) - _MAX_NAMED} more"
