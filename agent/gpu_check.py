"""The GPUs a start names are the GPUs the control plane reserved.

The control plane places a worker on GPU indexes, and sends the UUIDs it last heard for them. Between that
heartbeat and the start, a GPU may have been swapped, or a GPU that fell off the bus may have shifted the
indexes of those after it: index 1 would then be another GPU, perhaps one a second worker already uses.
``check_gpus`` refuses such a start, and ``named_by_uuid`` makes the worker's ``CUDA_VISIBLE_DEVICES`` name
the GPUs by UUID, which no renumbering changes.
"""

import msgspec

from agent.inventory import GpuInfo
from runtime.fleet_contract.tasks import WorkerSpec


class GpuMismatch(Exception):
    """The node's GPUs are not the ones the start was placed on. Not permanent: the next heartbeat tells the
    control plane what the node has, and the start is placed again."""


def check_gpus(spec: WorkerSpec, gpus: list[GpuInfo]) -> None:
    """Raise GpuMismatch unless each of ``spec``'s GPU indexes is on this node with the UUID the spec says."""
    here = {gpu.index: gpu for gpu in gpus}
    missing = [index for index in spec.gpu_indexes if index not in here]
    if missing:
        raise GpuMismatch(
            f"GPU {', '.join(map(str, missing))} is not on this node (it has {len(gpus)}): the control plane "
            "placed the worker on GPUs it no longer has; the next heartbeat tells it"
        )
    if not spec.gpu_uuids:
        return  # the control plane has no UUIDs for them (an older agent registered the node)
    if len(spec.gpu_uuids) != len(spec.gpu_indexes):
        raise GpuMismatch(
            f"the task names {len(spec.gpu_indexes)} GPU indexes and {len(spec.gpu_uuids)} UUIDs: it is malformed"
        )
    for index, uuid in zip(spec.gpu_indexes, spec.gpu_uuids, strict=True):
        if here[index].uuid != uuid:
            raise GpuMismatch(
                f"GPU {index} is {here[index].uuid} on this node, but the control plane reserved {uuid}: the "
                "node's GPUs changed since its last heartbeat, which tells the control plane"
            )


def named_by_uuid(spec: WorkerSpec, gpus: list[GpuInfo]) -> WorkerSpec:
    """``spec`` with its GPUs named to CUDA by UUID when they are real; simulated GPUs keep their indexes
    (their UUIDs mean nothing to CUDA)."""
    here = {gpu.index: gpu for gpu in gpus}
    if any(here[index].simulated for index in spec.gpu_indexes if index in here):
        return msgspec.structs.replace(spec, gpu_uuids=[])
    uuids = [here[index].uuid for index in spec.gpu_indexes]
    return msgspec.structs.replace(spec, gpu_uuids=uuids)
