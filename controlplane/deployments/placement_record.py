"""A placement decision as a person reads it: kept on the instance (``Instance.placement``), shown on its page.

``decision_record(demand, inventory, chosen, unschedulable)`` is pure, like ``placement.place``: it says
what the replica needed, where it went (node and GPUs), and for every node considered why it was passed
over (cordoned, draining, offline, not pinned, not running the engine, short of free GPUs or memory), or
that it fitted but the policy preferred another; or, when no node fits, the reason ``place`` gave. The
nodes are judged against the inventory the group was placed from, so for the second replica of one
placement a node may read "fits" although the first took room on it.
"""

from collections.abc import Iterable
from typing import Any

from controlplane.deployments.placement import (
    Demand,
    GpuInventory,
    NodeInventory,
    ReplicaPlacement,
    format_bytes,
)

#: Nodes listed in a record, at most (a large fleet's record stays small).
MAX_CANDIDATES = 50


def decision_record(
    demand: Demand,
    inventory: Iterable[NodeInventory],
    chosen: ReplicaPlacement | None,
    unschedulable: str = "",
) -> dict[str, Any]:
    """The JSON document of one replica's placement: ``policy``, ``need``, ``node`` and ``gpus`` (None and []
    when it did not fit), ``unschedulable`` (why not, or ""), and ``candidates``: each node considered, as
    ``{"node", "chosen", "fits", "why"}``."""
    nodes = list(inventory)
    candidates = []
    for node in nodes[:MAX_CANDIDATES]:
        is_chosen = chosen is not None and node.name == chosen.node
        why = _passed_over(demand, node)
        if is_chosen:
            why = "chosen"
        elif not why:
            why = _preferred_other(demand, chosen)
        candidates.append(
            {"node": node.name, "chosen": is_chosen, "fits": is_chosen or why.startswith("fits"), "why": why}
        )
    return {
        "policy": demand.policy,
        "need": _need(demand),
        "node": chosen.node if chosen is not None else None,
        "gpus": list(chosen.gpu_indexes) if chosen is not None else [],
        "unschedulable": "" if chosen is not None else unschedulable,
        "candidates": candidates,
        "more_nodes": max(0, len(nodes) - MAX_CANDIDATES),
    }


def _passed_over(demand: Demand, node: NodeInventory) -> str:
    """Why ``node`` cannot take the replica, or "" when it can."""
    if demand.pinned_nodes and node.name not in demand.pinned_nodes:
        return f"not among the pinned nodes ({', '.join(sorted(demand.pinned_nodes))})"
    if not node.schedulable:
        return f"{node.unschedulable_because}: takes no new instances"
    if not node.runs(demand.engine):
        return f"does not run {demand.engine}"
    node_need = demand.node_memory_bytes
    if node_need is not None and node.memory_free_bytes < node_need:
        what = "system memory" if demand.gpus_per_replica == 0 else "system memory for the host KV tier"
        free = format_bytes(max(0, node.memory_free_bytes))
        return f"not enough free {what}: {free} free, needs {format_bytes(node_need)}"
    if demand.gpus_per_replica == 0:
        return ""
    eligible = [gpu for gpu in node.gpus if not demand.pinned_gpus or gpu.index in demand.pinned_gpus]
    fitting = [gpu for gpu in eligible if _gpu_fits(demand, gpu)]
    if len(fitting) >= demand.gpus_per_replica:
        return ""
    if not eligible:
        pinned = (
            f" among the pinned GPUs ({', '.join(map(str, sorted(demand.pinned_gpus)))})" if demand.pinned_gpus else ""
        )
        return f"no GPU{pinned}"
    per_gpu = demand.memory_per_gpu_bytes
    if per_gpu is None:
        return f"{len(fitting)} unused GPU{'s' if len(fitting) != 1 else ''}, needs {demand.gpus_per_replica}"
    most = max(gpu.memory_free_bytes for gpu in eligible)
    return (
        f"not enough free GPU memory: {len(fitting)} of its GPUs ha{'s' if len(fitting) == 1 else 've'} "
        f"{format_bytes(per_gpu)} free, needs {demand.gpus_per_replica} (the freest has {format_bytes(max(0, most))})"
    )


def _gpu_fits(demand: Demand, gpu: GpuInventory) -> bool:
    need = demand.memory_per_gpu_bytes
    return gpu.instances == 0 if need is None else gpu.memory_free_bytes >= need


def _preferred_other(demand: Demand, chosen: ReplicaPlacement | None) -> str:
    if chosen is None:
        return "fits, but not once the group's other replicas took their room"
    if demand.policy == "spread":
        rule = "fewer replicas of this group, then fewer instances, then more free memory"
    else:
        rule = "the least free memory that still fits (binpack)"
    return f"fits, but {chosen.node} came first: {rule}"


def _need(demand: Demand) -> str:
    if demand.gpus_per_replica == 0:
        need = demand.node_memory_bytes
        return "a node (CPU)" if need is None else f"a node with {format_bytes(need)} of free memory (CPU)"
    per_gpu = demand.memory_per_gpu_bytes
    gpus = f"{demand.gpus_per_replica} GPU{'s' if demand.gpus_per_replica != 1 else ''}"
    memory = " (unused: its memory need is unknown)" if per_gpu is None else f" with {format_bytes(per_gpu)} free each"
    host = demand.host_memory_per_replica_bytes
    tier = f" and {format_bytes(host)} of system memory for its host KV tier" if host else ""
    return f"{gpus}{memory}{tier}"
