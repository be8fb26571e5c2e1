"""The placement record an instance keeps: for each node considered, why it was passed over, in words."""

from controlplane.deployments.placement import (
    Demand,
    GpuInventory,
    NodeInventory,
    Placement,
    ReplicaPlacement,
    place,
)
from controlplane.deployments.placement_record import decision_record

GiB = 1 << 30


def gpu_node(name: str, *free_gib: float, because: str = "", engines: frozenset[str] | None = None) -> NodeInventory:
    gpus = tuple(GpuInventory(index, 80 * GiB, int(free * GiB)) for index, free in enumerate(free_gib))
    return NodeInventory(name, gpus, memory_free_bytes=64 * GiB, unschedulable_because=because, engines=engines)


def reasons(record: dict[str, object]) -> dict[str, str]:
    return {row["node"]: row["why"] for row in record["candidates"]}  # type: ignore[attr-defined]


def test_each_node_passed_over_says_why() -> None:
    demand = Demand(replicas=1, gpus_per_replica=2, memory_per_replica_bytes=40 * GiB, engine="vllm")
    inventory = [
        gpu_node("a", 80, 80, engines=frozenset({"vllm"})),
        gpu_node("b", 80, 80, because="draining"),
        gpu_node("c", 80, 80, engines=frozenset({"mocker"})),
        gpu_node("d", 30, 10, engines=frozenset({"vllm"})),
        gpu_node("e", 80, 80, engines=frozenset({"vllm"})),
    ]
    result = place(demand, inventory)
    assert isinstance(result, Placement) and result.replicas == (ReplicaPlacement("a", (0, 1)),)
    record = decision_record(demand, inventory, result.replicas[0])
    assert record["need"] == "2 GPUs with 20 GiB free each"
    assert (record["node"], record["gpus"], record["unschedulable"]) == ("a", [0, 1], "")
    assert reasons(record) == {
        "a": "chosen",
        "b": "draining: takes no new instances",
        "c": "does not run vllm",
        "d": "not enough free GPU memory: 1 of its GPUs has 20 GiB free, needs 2 (the freest has 30 GiB)",
        "e": "fits, but a came first: fewer replicas of this group, then fewer instances, then more free memory",
    }


def test_pins_and_system_memory_are_reasons_too() -> None:
    demand = Demand(
        replicas=1,
        gpus_per_replica=0,
        memory_per_replica_bytes=16 * GiB,
        pinned_nodes=frozenset({"a", "b"}),
        policy="binpack",
    )
    inventory = [
        NodeInventory("a", memory_free_bytes=8 * GiB),
        NodeInventory("b", memory_free_bytes=32 * GiB),
        NodeInventory("c", memory_free_bytes=64 * GiB),
    ]
    record = decision_record(demand, inventory, ReplicaPlacement("b"))
    assert record["need"] == "a node with 16 GiB of free memory (CPU)"
    assert reasons(record) == {
        "a": "not enough free system memory: 8 GiB free, needs 16 GiB",
        "b": "chosen",
        "c": "not among the pinned nodes (a, b)",
    }


def test_an_unschedulable_record_keeps_the_reason_place_gave() -> None:
    demand = Demand(replicas=1, gpus_per_replica=1, memory_per_replica_bytes=None)
    inventory = [NodeInventory("cpu-only", memory_free_bytes=64 * GiB)]
    result = place(demand, inventory)
    reason = getattr(result, "reason", "")
    record = decision_record(demand, inventory, None, reason)
    assert record["node"] is None and record["unschedulable"] == reason != ""
    assert reasons(record) == {"cpu-only": "no GPU"}
