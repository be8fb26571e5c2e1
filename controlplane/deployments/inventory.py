"""The fleet as placement sees it: nodes, their GPUs and what is free, read from the database.

Free GPU memory is the GPU's total minus the larger of what its agent reports used and what the instances
placed on it reserve (their model's memory need, split over their GPUs). Reported use covers processes
the control plane does not know; reservations cover instances that were placed but have not loaded yet.
Taking the larger does not count our own running instances twice. Free system memory (for CPU replicas,
and for any replica's host KV tier) is likewise the smaller of what the agent reports available and the
total minus reservations: a CPU replica's model and every replica's host tier.
"""

import math
from collections import defaultdict

from controlplane.deployments.instance_states import LIVE_STATES, InstanceState
from controlplane.deployments.kv_tiers import GIB
from controlplane.deployments.models import Instance
from controlplane.deployments.placement import GpuInventory, NodeInventory
from controlplane.fleet.models import Node


def fleet_inventory() -> list[NodeInventory]:
    """Every registered node with its GPUs, free memory and instance counts."""
    reserved_gpu: dict[tuple[int, int], int] = defaultdict(int)
    gpu_instances: dict[tuple[int, int], int] = defaultdict(int)
    reserved_memory: dict[int, int] = defaultdict(int)
    node_instances: dict[int, int] = defaultdict(int)
    # A stopping instance's worker still holds its GPUs and memory until it has stopped (a restart in place
    # among them): counted as free, another instance placed there would start on a GPU still in use.
    holding = LIVE_STATES | {InstanceState.STOPPING}
    placed = Instance.objects.filter(state__in=holding, node__isnull=False).values_list(
        "node_id",
        "gpu_indexes",
        "group__gpus_per_replica",
        "pipeline__model__memory_bytes",
        "pipeline__kv_host_cache_gib",
    )
    for node_id, gpu_indexes, gpus_per_replica, memory_bytes, host_gib in placed:
        node_instances[node_id] += 1
        reserved_memory[node_id] += host_tier_bytes(host_gib)
        need = memory_bytes or 0
        if not gpu_indexes:
            reserved_memory[node_id] += need
            continue
        per_gpu = math.ceil(need / max(1, gpus_per_replica))
        for index in gpu_indexes:
            reserved_gpu[node_id, index] += per_gpu
            gpu_instances[node_id, index] += 1
    inventory = []
    for node in Node.objects.prefetch_related("gpus").order_by("name"):
        gpus = tuple(
            GpuInventory(
                index=gpu.index,
                name=gpu.name,
                memory_total_bytes=gpu.memory_total_bytes,
                memory_free_bytes=gpu.memory_total_bytes - max(gpu.memory_used_bytes, reserved_gpu[node.pk, gpu.index]),
                instances=gpu_instances[node.pk, gpu.index],
            )
            for gpu in node.gpus.all()
        )
        memory_free = min(node.memory_available_bytes, node.memory_total_bytes - reserved_memory[node.pk])
        intent = "draining" if node.draining else "cordoned" if node.cordoned else ""
        because = node.state if node.state != Node.State.ONLINE else intent
        inventory.append(
            NodeInventory(
                name=node.name,
                gpus=gpus,
                memory_free_bytes=memory_free,
                instances=node_instances[node.pk],
                unschedulable_because=because,
                engines=frozenset(node.engines),
            )
        )
    return inventory


def host_tier_bytes(host_gib: float | None) -> int:
    """A replica's host KV tier in bytes, rounded up (placement never reserves less than the engine takes)."""
    return math.ceil((host_gib or 0) * GIB)
